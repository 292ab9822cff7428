"""Starting Ray and the cluster: ``init_ray`` (a local Ray on 127.0.0.1, or join one by
address) and ``build_cluster`` (the named ``SchedulerActor``, which starts its workers).

    init_ray()                                   # local, loopback only
    handle = build_cluster(ClusterConfig(...))   # blocks until every instance is ready
    client = ClusterClient(handle)
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from cluster.config import ClusterConfig

logger = logging.getLogger(__name__)

DEFAULT_NAME = "tandem-scheduler"
DEFAULT_NAMESPACE = "tandem"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's: the head node alone has it


def ray_env_defaults() -> None:
    """Environment a loopback Ray needs (see docs/cluster.md): without the first variable a
    127.0.0.1 node address hangs ``ray.init`` (Ray then looks up an external address); the
    second keeps local runs free of auth tokens. Ray reads the first at import, so if it is
    imported already its constant is set as well."""
    import sys

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[attr-defined]


def init_ray(
    address: str | None = None,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    num_cpus: int | None = None,
    resources: dict[str, float] | None = None,
    object_store_memory: int | None = None,
) -> None:
    """Connect to Ray: join the cluster at ``address`` (``"auto"``: the one started on this
    machine by ``ray start``), or start a local one bound to 127.0.0.1."""
    import ray

    ray_env_defaults()
    if ray.is_initialized():
        return
    if address is not None:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
        return
    ray.init(
        _node_ip_address="127.0.0.1",
        namespace=namespace,
        num_cpus=num_cpus,
        resources=resources,
        object_store_memory=object_store_memory,
        include_dashboard=False,
        log_to_driver=False,
    )


def local_node_resources(config: ClusterConfig) -> dict[str, float]:
    """Custom resources a one-node local Ray must offer so that every pool can be placed."""
    names = {
        name
        for pool in config.pools
        for resources in [pool.resources, *(pool.stage_resources or [])]
        for name in resources
    }
    return {name: 1000.0 for name in sorted(names)}


def scheduler_actor_class() -> Any:
    import ray

    from cluster.control.scheduler_actor import SchedulerActor

    # An async actor: every generate() stream and the engine loops share its event loop.
    return ray.remote(SchedulerActor)


class ClusterNameTaken(ValueError):
    """``build_cluster``: the name is another cluster's (it may have been taken a moment
    ago: another process built one by that name at the same time)."""


def central_actor_options(
    config: ClusterConfig, name: str, namespace: str, detached: bool
) -> dict[str, Any]:
    """The Ray options of the central ``SchedulerActor``."""
    options: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "num_cpus": 0,
        "max_concurrency": 10_000,  # one slot per concurrent generate() stream
        # On the head node, wherever the builder runs (a Serve replica on a worker node): a
        # worker node that goes (scaled down, preempted) never takes the control plane with
        # it; the head's loss ends the Ray cluster anyway. (Ray pins its own state actors so.)
        "resources": {HEAD_NODE_RESOURCE: 0.001},
        # Never in the builder's placement group (a Serve replica given
        # placement_group_bundles captures its children into it): no bundle has the head's
        # resource, so the actor would wait there forever. An explicit strategy is not
        # captured.
        "scheduling_strategy": "DEFAULT",
    }
    if config.engine_actors:
        # Restartable: the engines, workers and client streams outlive it, and a restarted
        # one rebuilds its state from the engines (control/restart.py).
        options["max_restarts"] = -1
    if detached:
        options["lifetime"] = "detached"
    return options


def build_cluster(
    config: ClusterConfig,
    *,
    name: str = DEFAULT_NAME,
    namespace: str = DEFAULT_NAMESPACE,
    detached: bool = False,
) -> Any:
    """Create the named SchedulerActor and start every instance (workers placed by their
    pools' resources, models loaded in parallel). Returns the actor handle once ready; the
    workers live and die with it."""
    import ray

    options = central_actor_options(config, name, namespace, detached)
    try:
        handle = scheduler_actor_class().options(**options).remote(config)
    except ray.exceptions.ActorAlreadyExistsError as exc:
        raise ClusterNameTaken(f"a cluster named {name!r} runs already") from exc
    try:
        described = ray.get(handle.start.remote())
    except BaseException:  # (a failed start, or Ctrl-C while it ran)
        ray.kill(handle)
        if config.engine_actors:  # its workers and engines are detached: they outlive it
            kill_detached(handle)
        raise
    logger.info("cluster %s ready: %s", name, described)
    return handle


def kill_detached(handle: Any, timeout_s: float = 10.0) -> list[str]:
    """Kill the detached actors (workers, engines) of a central scheduler ``handle`` that
    was killed for good; returns their names. (A restartable one's outlive it on purpose: a
    start cut short, though, left them holding their nodes' resources for as long as Ray
    ran.) They are listed once it is dead (``ray.kill`` does not wait): one it created in
    between would be missed. Their names hold its actor id, unique across namespaces."""
    import ray

    from cluster.control.placement import named_actors, worker_actor_prefix
    from cluster.control.remote_engine import engine_actor_prefix

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=1.0)
        except ray.exceptions.RayActorError:
            break  # dead
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.05)
    central = handle._actor_id.hex()
    prefixes = (worker_actor_prefix(central), engine_actor_prefix(central))
    killed = []
    for name, namespace in named_actors(prefixes):
        try:
            ray.kill(ray.get_actor(name, namespace=namespace))
        except ValueError:  # gone meanwhile
            continue
        killed.append(name)
    return killed


def app_cluster_name(app_name: str) -> str:
    """The name of the cluster a Serve app runs on: the default app's (``tandem``, as
    ``tandem serve`` deploys it) is the default name, so ``tandem scale`` / ``tandem down``
    find it without ``--name``."""
    return DEFAULT_NAME if app_name == "tandem" else f"tandem-{app_name}"


def settings_changed(running: dict[str, Any], wanted: ClusterConfig) -> list[str]:
    """The cluster settings (``ClusterConfig.cluster_settings``) in which ``wanted`` differs
    from a running cluster's (``SchedulerActor.settings()``): top-level names, and
    ``serve.<field>`` inside ``serve``."""
    new = wanted.cluster_settings()
    changed = []
    for key in sorted(new.keys() | running.keys()):
        a, b = new.get(key), running.get(key)
        if key == "serve" and isinstance(a, dict) and isinstance(b, dict):
            changed += [f"serve.{k}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
        elif a != b:
            changed.append(key)
    return changed


def get_or_build_cluster(
    config: ClusterConfig, *, name: str, namespace: str = DEFAULT_NAMESPACE
) -> Any:
    """The running cluster ``name`` if its settings are ``config``'s (the ingress-only part of
    ``serve`` may differ), else a new one. A new one is detached: its lifetime is
    explicit, it outlives whoever asked for it (a Serve replica replaced by a redeploy) until
    ``shutdown_cluster`` (``tandem down``). ``ValueError`` when ``name`` runs with other
    settings: they cannot change under running requests. One found still starting (another
    replica builds it) is returned once started; one whose builder died before starting it,
    or whose start failed and was left, is started here. Two replicas building it at once
    build one: the one that names it second uses the first's."""
    import ray

    try:
        handle = get_cluster(name, namespace)
    except ValueError:
        try:
            return build_cluster(config, name=name, namespace=namespace, detached=True)
        except ClusterNameTaken:  # another replica named it since: that one is used
            handle = get_cluster(name, namespace)
    changed = settings_changed(ray.get(handle.settings.remote()), config)
    if changed:
        raise ValueError(
            f"cluster {name!r} is running with other settings ({', '.join(changed)}); stop it "
            f"first (tandem down --name {name}), or deploy with its settings: only the "
            "ingress's serve fields (key, ports, replicas) may change under a running cluster"
        )
    ray.get(handle.start.remote())  # (at once when it is started)
    logger.info("cluster %s is running: reused", name)
    return handle


def get_cluster(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE) -> Any:
    """The handle of a running cluster's SchedulerActor (``ValueError`` if there is none)."""
    import ray

    return ray.get_actor(name, namespace=namespace)


def shutdown_cluster(handle: Any) -> None:
    """Stop the loops, end what is in flight, kill the workers and the actor."""
    import ray

    try:
        ray.get(handle.shutdown.remote(), timeout=60)
    finally:
        ray.kill(handle)
        # What its shutdown did not stop (it timed out, or the actor was gone): its detached
        # workers and engines, if it ran any.
        kill_detached(handle)
