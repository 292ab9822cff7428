"""Whether the Ray cluster can hold a pool's workers: checked before they are created, so a
pool no node (and no node the Ray autoscaler may add) can hold fails at once, naming the
pool, instead of leaving its actors pending until the start-up timeout."""

from __future__ import annotations

from typing import Any

from cluster.config import ClusterConfig, InstancePool


def check_placeable(
    config: ClusterConfig,
    nodes: list[dict[str, Any]],
    launchable: list[dict[str, float]] | None = None,
    pools: list[InstancePool] | None = None,
) -> None:
    """Fail fast, naming the pool, when no live node offers what one of its workers needs
    and the Ray autoscaler cannot launch one that does (Ray would otherwise keep the actor
    pending until the start-up timeout). ``launchable``: the resources of the node groups
    the autoscaler may still add (``launchable_node_groups``); with one that fits, the
    worker's pending demand is what makes the autoscaler (or KubeRay) add the node. ``pools``:
    the pools to check (default: every pool of ``config``; a grow checks only its own -- another
    pool whose nodes are gone must not stop it)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", n.get("alive", True))]
    for pool in config.pools if pools is None else pools:
        for rank in range(pool.pp_size):
            _check_stage(pool, rank, alive, launchable or [])


def launchable_node_groups() -> list[dict[str, float]]:
    """The resources of each node group the Ray autoscaler may add nodes of (a KubeRay
    worker group with ``maxReplicas`` above 0, a cluster launcher's node type; how many it
    runs already is not checked), from the cluster config in the GCS, where Ray Data reads
    them for scale-from-zero too; none without an autoscaler."""
    try:
        from ray._private.state import state

        cluster = state.get_cluster_config()
    except Exception:  # an older Ray, or none connected: only live nodes count
        return []
    if cluster is None:
        return []
    groups = cluster.node_group_configs
    return [
        {k: float(v) for k, v in g.resources.items()}
        for g in groups
        if g.resources and g.max_count != 0
    ]


def _check_stage(
    pool: InstancePool,
    rank: int,
    alive: list[dict[str, float]],
    launchable: list[dict[str, float]],
) -> None:
    need = {**pool.resources_of_stage(rank), "CPU": pool.num_cpus, "GPU": pool.num_gpus}
    need = {k: v for k, v in need.items() if v > 0}
    if not any(all(res.get(k, 0.0) >= v for k, v in need.items()) for res in alive + launchable):
        offered = sorted({k for res in alive for k in res if not k.startswith("node:")})
        what = f"stage {rank} of each instance" if pool.pp_size > 1 else "per worker"
        groups = "; nor can the Ray autoscaler add one" if launchable else ""
        raise ValueError(
            f"pool {pool.name!r} needs {need} {what} but no node offers that{groups}; the "
            f"cluster's nodes offer: {', '.join(offered) or 'nothing'}. Start nodes with "
            "those resources (ray start --resources='{...}'), or change the pool."
        )
