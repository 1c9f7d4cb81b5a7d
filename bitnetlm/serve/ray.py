"""Replicas on Ray Serve: N copies of the server's app (one engine each) behind Serve's router and autoscaler.

Each replica is a Ray actor running the same FastAPI app as `bitnet serve` (create_app: same routes, auth and
limits) with its own engine; Serve's proxy spreads requests over the replicas and, with `max_replicas` above
`replicas`, adds or removes replicas by the requests in flight per replica (`autoscaling_config`). A replica
that dies is replaced by Serve's controller; only the requests it was running fail (5xx).

/metrics is aggregated: every replica sends its engine's Prometheus text to a one-replica hub deployment each
`METRICS_PERIOD_S`, and /metrics on any replica returns every live replica's series, labelled `replica`.

Library: `app = build(model, server_cfg, ReplicaConfig(...))` for `serve.run(app)` or a `serve_config.yaml`
(`import_path: bitnetlm.serve.ray:app_from_args`); `serve_replicas(...)` is `bitnet serve --replicas N`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from dataclasses import dataclass

from bitnetlm.serve.app import ServerConfig, create_app

METRICS_PERIOD_S = 1.0  # how often a replica sends its metrics to the hub
METRICS_STALE_S = 10.0  # a replica silent this long (dead, or replaced) drops out of /metrics
HUB = "bitnet-metrics"
DEPLOYMENT = "bitnet"


@dataclass(frozen=True)
class ReplicaConfig:
    """How many engine replicas, and what each one holds. `max_replicas` > `replicas` turns on autoscaling between
    the two on the requests in flight per replica (`target_requests`)."""

    replicas: int = 1
    max_replicas: int | None = None
    cpus: float = 1.0  # CPU cores reserved per replica (the engine's thread count follows it when not given)
    gpus: float = 0.0  # GPUs per replica (1 = one GPU each)
    target_requests: int = 8

    def __post_init__(self):
        for flag, v, low in (
            ("--replicas", self.replicas, 1),
            ("--target-requests", self.target_requests, 1),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{flag} {v!r}: expected an integer >= {low}")
        if self.max_replicas is not None and (
            isinstance(self.max_replicas, bool)
            or not isinstance(self.max_replicas, int)
            or self.max_replicas < self.replicas
        ):
            raise ValueError(
                f"--max-replicas {self.max_replicas!r}: expected an integer >= --replicas ({self.replicas})"
            )
        for flag, v in (("--replica-cpus", self.cpus), ("--replica-gpus", self.gpus)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{flag} {v!r}: expected a number >= 0")

    def options(self) -> dict:
        """serve.deployment options."""
        actor = {"num_cpus": self.cpus, "num_gpus": self.gpus}
        if self.max_replicas is not None and self.max_replicas > self.replicas:
            scale = {
                "min_replicas": self.replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_requests,
            }
            return {"autoscaling_config": scale, "ray_actor_options": actor}
        return {"num_replicas": self.replicas, "ray_actor_options": actor}


# ---- metrics ---------------------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(.*)$")


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus text of several replicas -> one exposition: each family's HELP/TYPE once, its samples from every
    replica with a `replica` label added (replicas in sorted order)."""
    families: dict[str, list[str]] = {}  # family -> header lines + samples, in first-seen order
    seen_header: set[str] = set()
    for rid in sorted(texts):
        family = None
        for line in texts[rid].splitlines():
            if line.startswith("# "):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    lines = families.setdefault(family, [])
                    if (parts[1], family) not in seen_header:
                        seen_header.add((parts[1], family))
                        lines.append(line)
                continue
            m = _SAMPLE.match(line)
            if not m:
                continue
            name, labels, value = m.groups()
            label = f'replica="{rid}"'
            labels = "{" + label + ("," + labels[1:] if labels and labels != "{}" else "}")
            families.setdefault(family or name, []).append(f"{name}{labels} {value}")
    return "".join(line + "\n" for lines in families.values() for line in lines)


class MetricsHub:
    """One replica of this deployment keeps the latest metrics text of every engine replica."""

    def __init__(self):
        self.latest: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.latest[replica] = (time.monotonic(), text)

    def collect(self) -> str:
        now = time.monotonic()
        self.latest = {r: v for r, v in self.latest.items() if now - v[0] < METRICS_STALE_S}
        return merge_metrics({r: text for r, (_, text) in self.latest.items()})


def _replica_id() -> str:
    from ray import serve

    rid = serve.get_replica_context().replica_id
    return getattr(rid, "unique_id", None) or str(rid)


def _send_metrics(app, hub, replica: str, stop: threading.Event) -> None:
    while not stop.wait(METRICS_PERIOD_S):
        engine = app.state.bitnet.engine
        if engine is not None:
            hub.put.remote(replica, engine.metrics.render())


def _app_builder(model, cfg: ServerConfig, app_name: str):
    """The function each replica runs to build its ASGI app (Serve pickles it with its closure)."""

    def build():
        from fastapi.responses import PlainTextResponse
        from fastapi.routing import APIRoute
        from ray import serve

        from bitnetlm.serve.server import _loader

        app = create_app(cfg, loader=_loader(model, cfg.runtime))
        hub = serve.get_deployment_handle(HUB, app_name=app_name)

        async def metrics():
            return PlainTextResponse(await hub.collect.remote(), media_type="text/plain; version=0.0.4")

        # ahead of the router's own /metrics, behind the app's auth middleware like every route
        app.router.routes.insert(0, APIRoute("/metrics", metrics, methods=["GET"]))
        stop = threading.Event()
        args = (app, hub, _replica_id(), stop)
        threading.Thread(target=_send_metrics, args=args, name="bitnet-metrics", daemon=True).start()
        return app

    return build


def build(model, cfg: ServerConfig, replicas: ReplicaConfig, app_name: str = "default"):
    """The Ray Serve application: engine replicas (each `create_app` on `model`) plus the metrics hub."""
    from ray import serve

    if cfg.runtime.threads is None and replicas.gpus == 0:
        # a replica's engine uses the cores Ray reserved for it, not every core of the node
        cfg = dataclasses.replace(cfg, runtime=cfg.runtime.replace(threads=max(1, int(replicas.cpus))))
    hub = serve.deployment(MetricsHub, name=HUB, num_replicas=1, ray_actor_options={"num_cpus": 0})
    ingress = serve.ingress(_app_builder(model, cfg, app_name))()
    engine = serve.deployment(ingress, name=DEPLOYMENT, max_ongoing_requests=1024, **replicas.options())
    return engine.bind(hub.bind())


def _server_config(model, kw: dict):
    """`bitnet serve` keywords -> (model name, ServerConfig), as serve() makes them."""
    from bitnetlm.runtime.config import RuntimeConfig
    from bitnetlm.serve.server import _config, _split

    kw = dict(kw)
    name = kw.pop("model_name", None) or (
        os.path.basename(os.path.normpath(os.fspath(model))) if model else "bitnet"
    )
    runtime = kw.pop("runtime", None) or RuntimeConfig()
    rt, eng, server = _split(kw)
    return _config(name, runtime.replace(**rt), eng, server)


def app_from_args(args: dict):
    """`serve run` / serve_config.yaml entry (`import_path: bitnetlm.serve.ray:app_from_args`): `args` holds
    `model`, the ReplicaConfig fields and any `bitnet serve` keyword (host and port are Serve's own settings)."""
    kw = dict(args)
    model = kw.pop("model", None)
    rep = ReplicaConfig(**{f: kw.pop(f) for f in list(kw) if f in ReplicaConfig.__dataclass_fields__})
    kw.pop("host", None), kw.pop("port", None)
    return build(model, _server_config(model, kw), rep)


def serve_replicas(model=None, *, replicas: ReplicaConfig, address: str | None = None, **kw) -> None:
    """`bitnet serve --replicas N`: start (or join, with `address`) a Ray cluster, run the replicas behind Serve's
    HTTP proxy on host:port, and block until SIGINT/SIGTERM. Keywords: those of `bitnetlm.serve.serve`."""
    import ray
    from ray import serve

    cfg = _server_config(model, kw)
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve.run(build(model, cfg, replicas), name="default", route_prefix="/", blocking=True)
    finally:
        serve.shutdown()
        ray.shutdown()
