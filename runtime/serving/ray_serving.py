"""`rbcompile serve ARTIFACT --ray --replicas N`: N replicas of the HTTP app behind Ray Serve's
proxy, with one controller for all of them.

Each replica is a Ray Serve deployment replica that loads the artifact itself (the path must be
readable on every node) and serves `create_app(...)` (runtime/serving/http.py) unchanged, through
`serve.ingress` with a builder function evaluated on the replica. Ray's proxy binds --host /
--port and spreads requests over the replicas; each response carries the replica's id in
`x-rbcompile-replica`.

The controller: one Ray actor, `ClusterBudget`, runs the policy `--policy` names (built as a
single server builds it, `serve_policy.build_policy`) over the aggregate of the replicas' states. On each
replica the DecodeController's policy is a `ClusterPolicy`: `observe` hands the local
`PolicyState` to a sender thread (the model thread never waits on Ray), which reports it to the
actor and keeps the cluster's answer; `decide` returns the latest answer. A slow or dead actor
leaves each replica on the last decision it received (counted in `failures`).

Ray is imported lazily: without the 'ray' extra, only `--ray` fails (`RAY_MISSING`, exit 2).
"""
from __future__ import annotations

import asyncio
import re
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from rbcompile.artifact import manifest as manifests
from rbcompile.artifact.executors import check_precision
from rbcompile.artifact.guard import DECODER, QualityGuard, lossy_budgets
from rbcompile.artifact.plans import stored_plans
from rbcompile.errors import UserError
from rbcompile.runtime.control.policy import BasePolicy, Decision, PolicyState
from rbcompile.runtime.engine.model import load
from rbcompile.runtime.serving.serve_config import ServeConfig
from rbcompile.runtime.serving.serve_policy import build_policy

# Deferred on purpose: ray is the optional 'ray' extra; only `serve --ray` imports it.

RAY_MISSING = "rbcompile serve --ray needs the 'ray' extra: pip install 'rbcompile[ray]'"
APP_NAME = "rbcompile"
REPLICA_HEADER = "x-rbcompile-replica"
CLUSTER_PATH = "/v1/rbcompile/cluster"
DRAIN_S = 60.0   # on SIGTERM each replica finishes its open requests for at most this long


def import_ray():
    """(ray, ray.serve), or a UserError naming the extra."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UserError(RAY_MISSING) from None
    return ray, serve


# ---- the cluster's view ------------------------------------------------------------------------

def aggregate(states: list[PolicyState], previous_budget: float = 0.0) -> PolicyState:
    """One PolicyState for the cluster: queues and arrivals add up; latencies, memory and CPU are
    the worst replica's (the SLO holds for every stream); confidence is the mean (its p10 the
    lowest); input length the mean; `previous_budget` the cluster's own last decision."""
    if not states:
        return PolicyState(previous_budget=previous_budget)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    first = states[0]
    return PolicyState(
        memory=max(s.memory for s in states), input_length=mean([s.input_length for s in states]),
        complexity=mean([s.complexity for s in states]),
        queue_depth=sum(s.queue_depth for s in states),
        arrival_rate=sum(s.arrival_rate for s in states),
        last_latency=max(s.last_latency for s in states),
        latency_p50=max(s.latency_p50 for s in states),
        latency_p99=max(s.latency_p99 for s in states),
        confidence_mean=mean([s.confidence_mean for s in states]),
        confidence_p10=min(s.confidence_p10 for s in states),
        cpu_utilisation=max(s.cpu_utilisation for s in states),
        previous_budget=previous_budget, slo_s=first.slo_s,
        max_length=min(s.max_length for s in states), max_queue=first.max_queue)


class ClusterBudget:
    """The one controller (a Ray actor under `serve --ray`; a plain object in tests): keeps the
    latest state of each replica (dropped after `stale_s` without a report: an idle replica
    stops reporting), and at most once per `period_s` runs the policy over their aggregate.
    `report` returns the current decision. A policy that raises leaves the last decision."""

    def __init__(self, policy: BasePolicy | None = None, period_s: float = 0.25,
                 stale_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.policy, self.period_s, self.stale_s, self.clock = policy, period_s, stale_s, clock
        self.decision = Decision()
        self.states: dict[str, tuple[float, PolicyState]] = {}
        self.reports: dict[str, int] = {}
        self.decisions = self.errors = 0
        self.last_error: str | None = None
        self.last_aggregate: PolicyState | None = None
        self._decided_at: float | None = None

    def start(self, config: ServeConfig, artifact: str) -> str | None:
        """Build the policy of `config` on the cluster, as a single server does
        (`serve_policy`; pid reads the artifact's plans, ppo its --policy-file): None, or the
        user error's text."""
        try:
            plans = stored_plans(manifests.read(Path(artifact))) if config.policy.policy == "pid" else None
            most = max(lossy_budgets(plans, config.guard or QualityGuard(), DECODER), default=0.0)
            self.policy = build_policy(config.policy, most)
        except UserError as exc:
            return str(exc)
        return None

    def report(self, replica_id: str, state: PolicyState) -> Decision:
        now = self.clock()
        self.states[replica_id] = (now, state)
        self.reports[replica_id] = self.reports.get(replica_id, 0) + 1
        for name in [n for n, (at, _) in self.states.items() if now - at > self.stale_s]:
            del self.states[name]
        if self.policy is not None and (self._decided_at is None or now - self._decided_at >= self.period_s):
            self._decided_at = now
            cluster = aggregate([s for _, s in self.states.values()], self.decision.budget)
            try:
                self.policy.observe(cluster)
                decision = self.policy.decide(cluster)
                if not isinstance(decision, Decision):
                    raise TypeError(f"decide returned {type(decision).__name__}, not Decision")
                self.decision, self.last_aggregate = decision, cluster
                self.decisions += 1
            except Exception as exc:  # keep the last decision
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
        return self.decision

    def summary(self) -> dict:
        """Replicas reporting (and their report counts), the decision, the aggregate it saw."""
        cluster = self.last_aggregate
        return {"policy": getattr(self.policy, "name", None), "budget": self.decision.budget,
                "decisions": self.decisions, "errors": self.errors, "last_error": self.last_error,
                "reports": dict(self.reports), "live_replicas": sorted(self.states),
                "aggregate": None if cluster is None else {
                    "queue_depth": cluster.queue_depth, "arrival_rate": cluster.arrival_rate,
                    "latency_p99": cluster.latency_p99, "memory": cluster.memory,
                    "confidence_mean": cluster.confidence_mean}}


class ClusterPolicy(BasePolicy):
    """A replica's view of the cluster controller. `report(state)` sends a state and returns the
    cluster's Decision (blocking, raising on failure or after its own timeout); it runs on a
    sender thread of its own, so `observe` (on the model thread) only leaves the newest state
    for it, and `decide` returns the last decision received (the default Decision until the
    first). Failed or late reports keep that decision and are counted in `failures`."""
    name = "cluster"

    def __init__(self, report: Callable[[PolicyState], Decision]):
        self._report = report
        self.decision = Decision()
        self.received = self.failures = 0
        self.received_at: float | None = None
        self.last_error: str | None = None
        self._latest: PolicyState | None = None
        self._closed = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._send, name="rbcompile-cluster", daemon=True)
        self._thread.start()

    @classmethod
    def for_actor(cls, actor, replica_id: str, timeout_s: float = 2.0) -> "ClusterPolicy":
        """Reports to a `ClusterBudget` actor as `replica_id`, each answer awaited `timeout_s`."""
        import ray

        return cls(lambda state: ray.get(actor.report.remote(replica_id, state), timeout=timeout_s))

    def observe(self, state: PolicyState) -> None:
        with self._wake:
            self._latest = state
            self._wake.notify()

    def decide(self, state: PolicyState) -> Decision:
        return self.decision

    def status(self) -> dict:
        age = None if self.received_at is None else time.monotonic() - self.received_at
        return {"budget": self.decision.budget, "received": self.received, "failures": self.failures,
                "seconds_since_decision": age, "last_error": self.last_error}

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    def _send(self) -> None:
        while True:
            with self._wake:
                while self._latest is None and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                state, self._latest = self._latest, None
            try:
                decision = self._report(state)
                if not isinstance(decision, Decision):
                    raise TypeError(f"the cluster answered {type(decision).__name__}, not Decision")
                self.decision, self.received_at = decision, time.monotonic()
                self.received += 1
            except Exception as exc:  # a slow or dead controller: keep the last decision
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that served it."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


# ---- the deployment ----------------------------------------------------------------------------

def app_builder(artifact: str, actor, config: ServeConfig) -> Callable:
    """The builder `serve.ingress` evaluates on each replica: load the artifact, make the app
    (`create_app(model, config)`) with a ClusterPolicy reporting to `actor`, name the replica."""

    def build():
        from ray import serve

        from rbcompile.runtime.serving.http import create_app  # FastAPI: on the replica only

        replica = serve.get_replica_context().replica_tag
        model = load(artifact)
        check_precision(model.manifest, config.weights, config.guard or model.guard,
                        config.prefill_weights)
        if model.decoder is not None:
            model.use_executor(config.executor, config.weights, prefill=config.prefill_weights)
        policy = ClusterPolicy.for_actor(actor, replica)
        app = create_app(model, config, policy=policy)

        @app.get(CLUSTER_PATH)
        async def cluster():
            """This replica, its engine's budget, its link to the controller and the
            controller's summary (the API key applies)."""
            try:
                summary = await asyncio.wait_for(asyncio.wrap_future(actor.summary.remote().future()), 2.0)
            except Exception as exc:  # the controller is slow or gone: say so
                summary = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            return {"replica": replica, "engine_budget": getattr(app.state.engine, "budget", None),
                    "link": policy.status(), "controller": summary}

        app.add_middleware(ReplicaHeader, replica=replica)
        return app

    return build


def deploy(artifact: str, config: ServeConfig, *, replicas: int, replica_cpus: float = 1.0,
           host: str = "127.0.0.1", port: int = 8000):
    """Start the controller actor and `replicas` replicas under Ray Serve (ray already
    initialised); returns the actor once every replica is up. Raises UserError for a policy
    the cluster cannot build."""
    ray, serve = import_ray()
    actor = ray.remote(ClusterBudget).options(num_cpus=0).remote()
    problem = ray.get(actor.start.remote(config, str(artifact)))
    if problem:
        ray.kill(actor)
        raise UserError(problem)
    deployment = serve.deployment(
        serve.ingress(app_builder(str(artifact), actor, config))(),
        name=APP_NAME, num_replicas=replicas, ray_actor_options={"num_cpus": replica_cpus},
        # the engine queues and sheds by QoS class itself: let every request reach a replica
        max_ongoing_requests=config.max_batch + config.limits.max_queue,
        graceful_shutdown_timeout_s=DRAIN_S)
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(deployment.bind(), name=APP_NAME, route_prefix="/")
    except RuntimeError as exc:   # the replicas failed to start (Ray retried them)
        raise UserError(f"Ray Serve could not start the replicas: {_replica_error(serve) or exc}") from None
    return actor


def _replica_error(serve) -> str | None:
    """The UserError a replica's constructor raised (an unreadable or corrupt artifact on its
    node, say), from the deployment's status message; None if it was something else."""
    try:
        message = serve.status().applications[APP_NAME].deployments[APP_NAME].message
    except Exception:
        return None
    found = re.findall(r"rbcompile\.errors\.UserError: (.*)", message or "")
    return found[-1].strip() if found else None


def serve_on_ray(args, config: ServeConfig) -> None:
    """`rbcompile serve --ray`: deploy, serve until SIGINT / SIGTERM, then delete the app (Ray
    Serve lets each replica finish its open requests, up to DRAIN_S) and leave the cluster (a
    Ray started here stops)."""
    ray, serve = import_ray()
    artifact, policy_file = args.artifact, args.policy_file
    if args.ray_address is None:   # Ray on this machine: paths as this shell sees them
        if not (Path(artifact) / "manifest.json").is_file():
            raise UserError(f"{artifact}: not an artifact folder (no manifest.json)")
        artifact = str(Path(artifact).resolve())
        policy_file = policy_file and str(Path(policy_file).resolve())
    local = {"include_dashboard": False} if args.ray_address is None else {}
    ray.init(address=args.ray_address, logging_level="WARNING", **local)
    try:
        if args.ray_address is None:
            cpus = ray.cluster_resources().get("CPU", 0)
            if args.replicas * args.replica_cpus > cpus:
                raise UserError(f"--replicas {args.replicas} x --replica-cpus {args.replica_cpus:g} "
                                f"needs {args.replicas * args.replica_cpus:g} CPUs; this machine's "
                                f"Ray has {cpus:g} (lower --replica-cpus, e.g. 0.5)")
        config = replace(config, policy=replace(config.policy, policy_file=policy_file))
        deploy(artifact, config, replicas=args.replicas, replica_cpus=args.replica_cpus,
               host=args.host, port=args.port)
        print(f"serving {args.artifact} on http://{args.host}:{args.port}/v1 with {args.replicas} "
              f"Ray Serve replicas (policy {args.policy}, one controller)", file=sys.stderr, flush=True)
        _wait_for_signal()
        print("rbcompile: draining the replicas", file=sys.stderr, flush=True)
        serve.delete(APP_NAME)   # only this app: other apps on a shared cluster stay
    finally:
        ray.shutdown()


def _wait_for_signal() -> None:
    """Block until SIGINT / SIGTERM (noted, not raised, so the drain runs)."""
    received = threading.Event()
    held = {signum: signal.signal(signum, lambda number, frame: received.set())
            for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not received.wait(1.0):
            pass
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
