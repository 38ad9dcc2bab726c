"""Running a model: the kernel-provider interface, the NumPy reference, the transformer, sampling, the engine."""
