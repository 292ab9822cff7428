"""``tandem plan``: the fewest instances that meet a workload's latency targets, found in
simulation.

For each cluster size from one instance up, every way to split it -- colocated instances
(role ``both``), or P prefill + D decode instances -- and every token budget
(``max_num_batched_tokens``) offered, per pool (a P/D shape tries each pair: a prefill pool
often wants a large budget, a decode pool a small one), is served the workload in the
simulator; the first size with a split that meets the SLO (``attainment`` of the requests
within both the TTFT and the TPOT target, DistServe's measure) and keeps up with the rate
wins, the split with the highest attainment (then goodput) among them. Keeping up: a short
run of a cluster too small for the rate meets the SLO while its queue is still short, so a
split that meets it is served the workload ``LONGER`` times over, back to back, and must
meet it there too. Its ClusterConfig is printed as YAML, with its goodput curve: attainment
and goodput at fractions and multiples of the rate (each over the longer run), so the margin
shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cluster.config import ClusterConfig, InstancePool
from cluster.sim.cost import CostModel
from cluster.sim.simulator import SLO, Simulation
from cluster.sim.workload import WorkItem
from scheduler import SchedulerConfig

# A split that meets the SLO is served the workload this many times over, back to back: a
# cluster too small for the rate meets it in a short run while its queue is still short.
LONGER = 3
CURVE = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)  # rates of the goodput curve, as multiples


@dataclass(frozen=True)
class Candidate:
    """A cluster shape: ``both`` colocated instances, or ``prefill`` + ``decode`` ones."""

    prefill: int = 0
    decode: int = 0
    both: int = 0
    max_num_batched_tokens: int = 2048  # the colocated or prefill pool's
    decode_batched_tokens: int | None = None  # the decode pool's (None: the same)

    @property
    def instances(self) -> int:
        return self.prefill + self.decode + self.both

    def budget(self, role: str) -> int:
        """The ``max_num_batched_tokens`` of the pool of ``role``."""
        if role == "decode" and self.decode_batched_tokens is not None:
            return self.decode_batched_tokens
        return self.max_num_batched_tokens

    def label(self) -> str:
        if self.both:
            return f"{self.both} colocated, max_num_batched_tokens {self.max_num_batched_tokens}"
        p, d = self.budget("prefill"), self.budget("decode")
        budgets = f"{p}" if p == d else f"P {p} / D {d}"
        return f"{self.prefill}P + {self.decode}D, max_num_batched_tokens {budgets}"

    def config(self, base: ClusterConfig) -> ClusterConfig:
        """``base`` with this shape's pools, each copied from ``base``'s pool of that role
        (a colocated one from its decode or colocated pool), with the token budget set and
        no autoscaling (the shape is what is judged). A P/D shape of a base that never
        disaggregates hands every request off (``disaggregation: always``); a colocated
        one never does."""
        by_role: dict[str, InstancePool] = {pool.role: pool for pool in base.pools}
        fallback = by_role.get("decode") or by_role.get("both") or base.pools[0]
        pools = []
        for role, count in (
            ("prefill", self.prefill),
            ("decode", self.decode),
            ("both", self.both),
        ):
            if not count:
                continue
            template = by_role.get(role) or fallback
            budget = self.budget(role)
            scheduler = {**template.scheduler, "max_num_batched_tokens": budget}
            # Lowered to the budget where it is over it (a running request takes a token of
            # it per step). Unset, it is the scheduler's default: the base's pools run that
            # many, and a larger one would judge (and print) a shape the base does not have.
            default = SchedulerConfig.model_fields["max_num_seqs"].default
            seqs = scheduler.get("max_num_seqs", default)
            scheduler["max_num_seqs"] = min(seqs, budget)
            update = {
                "name": role,
                "role": role,
                "replicas": count,
                "scheduler": scheduler,
                "autoscaling": None,
            }
            pools.append(template.model_copy(update=update).model_dump())
        data = base.model_dump()
        data["pools"] = pools
        if self.both:
            data["router"]["disaggregation"] = "never"
        elif data["router"].get("disaggregation") == "never":
            data["router"]["disaggregation"] = "always"
        return ClusterConfig.model_validate(data)


@dataclass
class Trial:
    candidate: Candidate
    summary: dict[str, Any]
    # The summary of the workload served LONGER times over (for those that meet the SLO).
    sustained: dict[str, Any] | None = None

    def meets(self, target: float) -> bool:
        return bool(self.summary.get("slo_attainment", 0.0) >= target)

    def keeps_up(self, target: float) -> bool:
        """Meets the SLO over the longer run too (True while that was not run)."""
        return self.sustained is None or self.sustained.get("slo_attainment", 0.0) >= target

    def rank(self) -> tuple[float, float]:
        """Which of two splits that both qualify is the better plan: the one with more margin
        under sustained load (the longer run's attainment, then goodput; the single run's
        where there was no longer one)."""
        summary = self.sustained or self.summary
        return (summary["slo_attainment"], summary["goodput_requests_s"])


def repeated(work: list[WorkItem], times: int) -> list[WorkItem]:
    """``work`` ``times`` times over, back to back: each copy one mean gap after the last
    arrival of the one before, with prefix groups of its own (no copy reuses another's
    prefixes). ``work`` itself when its arrivals have no span (a burst: keeping up with a
    rate means nothing there)."""
    if len(work) < 2 or times <= 1:
        return list(work)
    first = min(w.arrival_s for w in work)
    span = max(w.arrival_s for w in work) - first
    if span <= 0:
        return list(work)
    period = span + span / (len(work) - 1)
    groups = 1 + max((w.prefix_group for w in work if w.prefix_group is not None), default=-1)
    return [
        dataclasses.replace(
            w,
            arrival_s=w.arrival_s + k * period,
            prefix_group=None if w.prefix_group is None else w.prefix_group + k * groups,
        )
        for k in range(times)
        for w in work
    ]


@dataclass
class Plan:
    chosen: Trial | None  # None: nothing up to the largest size met the SLO
    trials: list[Trial]
    curve: list[dict[str, float]] = field(default_factory=list)  # rate, attainment, goodput
    config: ClusterConfig | None = None


def candidates(
    instances: int, batched_tokens: tuple[int, ...], colocated: bool, disaggregated: bool
) -> Iterator[Candidate]:
    for tokens in batched_tokens:
        if colocated:
            yield Candidate(both=instances, max_num_batched_tokens=tokens)
        if disaggregated:
            for prefill in range(1, instances):
                for decode_tokens in batched_tokens:
                    yield Candidate(
                        prefill,
                        instances - prefill,
                        max_num_batched_tokens=tokens,
                        decode_batched_tokens=decode_tokens,
                    )


def plan(
    base: ClusterConfig,
    cost: CostModel,
    workload: Callable[[float], list[WorkItem]],
    rate: float,
    slo: SLO,
    target: float = 0.9,
    max_instances: int = 16,
    batched_tokens: tuple[int, ...] = (2048,),
    colocated: bool = True,
    disaggregated: bool = True,
    seed: int = 0,
    progress: Callable[[Trial], None] | None = None,
) -> Plan:
    """The smallest cluster meeting ``slo`` for ``target`` of the requests of
    ``workload(rate)`` (``workload``: a rate -> its requests, the same seed each time), and
    of those of the workload served ``LONGER`` times over (it keeps up)."""
    work = workload(rate)
    trials: list[Trial] = []
    for size in range(1, max_instances + 1):
        here = []
        for candidate in candidates(size, batched_tokens, colocated, disaggregated):
            result = Simulation(candidate.config(base), cost).run(work, slo, seed)
            trial = Trial(candidate, result.summary())
            trials.append(trial)
            here.append(trial)
            if progress is not None:
                progress(trial)
        met = [t for t in here if t.meets(target)]
        longer = repeated(work, LONGER)
        for trial in met if len(longer) > len(work) else []:  # (a burst: no rate to keep up)
            config = trial.candidate.config(base)
            trial.sustained = Simulation(config, cost).run(longer, slo, seed).summary()
        met = [t for t in met if t.keeps_up(target)]
        if met:
            chosen = max(met, key=Trial.rank)
            config = chosen.candidate.config(base)
            curve = []
            for factor in CURVE:
                work_at = repeated(workload(rate * factor), LONGER)
                result = Simulation(config, cost).run(work_at, slo, seed)
                # goodput against the rate asked for (not the sample's own span: the curve's
                # points would all read the seed's few % above their rate) -- where there is
                # one: a burst (arrivals with no span) was offered at no rate (``rate`` is a
                # stand-in), and its goodput is per second of the run, the same at each point
                arrivals = [w.arrival_s for w in work_at]
                spread = len(arrivals) > 1 and max(arrivals) > min(arrivals)
                summary = result.summary(offered_rate=rate * factor if spread else None)
                curve.append(
                    {
                        "rate": rate * factor,
                        "attainment": summary["slo_attainment"],
                        "goodput": summary["goodput_requests_s"],
                    }
                )
            return Plan(chosen, trials, curve, config)
    return Plan(None, trials)


def config_yaml(config: ClusterConfig) -> str:
    """The parts of ``config`` that differ from the defaults, as YAML to serve it with."""
    import yaml

    data = config.model_dump(mode="json", exclude_defaults=True)
    return str(yaml.safe_dump(data, sort_keys=False))
