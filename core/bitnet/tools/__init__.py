"""Tools around runs: the bench harness and receipts."""
