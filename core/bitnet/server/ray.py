"""Scale-out with Ray Serve (extra `bitnet-core[ray]`): the same FastAPI app as `bitnet-select serve`, as
replicas of one Ray Serve deployment, each with its own model and continuous-batching scheduler. Ray
Serve routes requests to replicas, adds or removes them (autoscaling), and places them on the nodes of a
Ray cluster; the model file must be at the same path on every node.

    python -m bitnet.server.ray -m model.gguf --num-replicas 2            # a local Ray instance
    python -m bitnet.server.ray -m model.gguf --address auto --host 0.0.0.0 --min-replicas 1 --max-replicas 8

From Python: `serve.run(deployment(Settings(model=...), num_replicas=2), route_prefix="/")`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import click

from bitnet.server.app import Settings, create_app

log = logging.getLogger("bitnet.server.ray")


def deployment(settings: Settings, num_replicas: int | None = 1, autoscaling_config: dict[str, Any] | None = None,
               ray_actor_options: dict[str, Any] | None = None, name: str = "bitnet") -> Any:
    """A bound Ray Serve application of the OpenAI app: `num_replicas` replicas, or `autoscaling_config`
    (Ray's min_replicas, max_replicas, target_ongoing_requests, ...) instead. A replica loads its model
    before it takes traffic. `ray_actor_options` default: one CPU per replica."""
    from ray import serve

    settings = Settings(**{**settings.__dict__, "load_before_start": True})

    def build() -> Any:  # runs in each replica: the app (its model, its scheduler) is built there
        return create_app(settings)

    options: dict[str, Any] = {"name": name, "ray_actor_options": ray_actor_options or {"num_cpus": 1},
                               # A replica holds at most its slots plus its queue; Ray queues the rest.
                               "max_ongoing_requests": settings.parallel + settings.max_queue}
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas

    @serve.ingress(build)
    class BitnetReplica:
        pass

    return serve.deployment(BitnetReplica, **options).bind()


@click.command()
@click.option("--model", "-m", default=None, help="GGUF file, at this path on every node. Default: built-in.")
@click.option("--address", default=None,
              help="Ray cluster to join (`auto`: the one `ray start` runs here). Default: a local instance.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address Ray Serve's HTTP proxy binds.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--num-replicas", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--min-replicas", type=click.IntRange(min=0), default=None, help="With --max-replicas: autoscale.")
@click.option("--max-replicas", type=click.IntRange(min=1), default=None)
@click.option("--replica-cpus", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="CPUs Ray reserves for each replica.")
@click.option("--parallel", "-np", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--n-ctx", type=click.IntRange(min=1), default=None)
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True)
@click.option("--api-key", envvar="BITNET_API_KEY", default=None)
@click.option("--model-alias", default=None)
@click.option("--device", default=None)
def main(model: str | None, address: str | None, host: str, port: int, num_replicas: int, min_replicas: int | None,
         max_replicas: int | None, replica_cpus: float, parallel: int, n_ctx: int | None, max_queue: int,
         api_key: str | None, model_alias: str | None, device: str | None) -> None:
    """Serve the OpenAI API from Ray Serve replicas until SIGTERM or SIGINT."""
    if address is None:
        # A local instance talks over loopback only. Ray takes the node's outward address otherwise (it
        # means to be reachable from other nodes); this switch, read when Ray is imported (here and by its
        # workers, which inherit the environment), makes every Ray process use 127.0.0.1.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if address is None:  # a local instance on loopback only, without the dashboard
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, object_store_memory=100 << 20)
    else:
        ray.init(address=address)
    autoscaling = None
    if min_replicas is not None or max_replicas is not None:
        autoscaling = {"min_replicas": min_replicas or 1, "max_replicas": max_replicas or max(min_replicas or 1, 1)}
    settings = Settings(model=model, device=device, n_ctx=n_ctx, parallel=parallel, max_queue=max_queue,
                        api_key=api_key, model_alias=model_alias)
    serve.start(http_options={"host": host, "port": port})
    serve.run(deployment(settings, num_replicas, autoscaling, {"num_cpus": replica_cpus}), route_prefix="/")
    status = serve.status().applications["default"].deployments["bitnet"]
    log.info("ready: http://%s:%d/v1 with %s replicas", host, port, status.replica_states.get("RUNNING", 0))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down")
    if address is not None:  # leave the cluster running, without this application
        serve.delete("default")
    ray.shutdown()  # a local instance stops with its replicas


if __name__ == "__main__":
    main()
