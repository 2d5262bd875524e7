"""GPU-seconds per key or user: each instance's READY time x its GPU count (a CPU instance counts
as one device), in each hour, split across the keys that used it in proportion to their busy
seconds; the part nobody used is the instance's idle time.

In one hour, for an instance with `g` devices, READY for `r` seconds, whose keys were busy b_k
seconds (sum B): key k is charged g * b_k, and the instance idles g * (r - B). Should B exceed r
(several web processes counting at once, or an instance without READY history), the keys share
g * r in proportion to b_k (with no READY history at all, g * b_k), and nothing idles.

Here, in the data plane, because the proxy enforces teams' monthly GPU-seconds budgets with the
figure the console's pages and API show (serving.proxy.gpu_budget). Each hour's split depends on
that hour's rows only, so a range's figure is the sum of its parts' (cut at whole hours).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime

HOUR = 3600


def split_hour(*, ready_s: float, gpus: int, busy: dict) -> tuple[dict, float]:
    """(GPU-seconds per key, idle GPU-seconds) of one instance in one hour."""
    devices = max(1, gpus)
    total = sum(busy.values())
    if total <= 0:
        return {}, devices * max(0.0, ready_s)
    scale = min(1.0, ready_s / total) if ready_s > 0 else 1.0
    charged = {who: devices * b * scale for who, b in busy.items() if b > 0}
    return charged, devices * max(0.0, ready_s - total)


@dataclass
class InstanceInfo:
    instance_id: int
    model: str
    node: str
    gpus: int
    ready: list[tuple[float, float]]  # READY intervals (epoch seconds), clipped to the range


def ready_intervals(events: list[tuple[float, str]], *, start: float, end: float, ready_at_start: bool
                    ) -> list[tuple[float, float]]:
    """The READY intervals within [start, end) from one instance's transitions (time, to_state),
    oldest first; `ready_at_start` says whether it was READY when the range began."""
    out = []
    since = start if ready_at_start else None
    for at, state in events:
        if at < start or at >= end:
            continue
        if state == "READY":
            if since is None:
                since = at
        elif since is not None:
            out.append((since, at))
            since = None
    if since is not None:
        out.append((since, end))
    return [(a, b) for a, b in out if b > a]


def ready_by_hour(intervals: list[tuple[float, float]]) -> dict[int, float]:
    """Seconds of READY time in each hour (keyed by the hour's epoch start)."""
    hours: dict[int, float] = defaultdict(float)
    for a, b in intervals:
        t = a
        while t < b:
            hour = int(t // HOUR * HOUR)
            upto = min(b, hour + HOUR)
            hours[hour] += upto - t
            t = upto
    return hours


def _instances(start: datetime, end: datetime, ids: set[int]) -> dict[int, InstanceInfo]:
    """READY history of every instance READY at some point in [start, end), and of `ids`."""
    from django.db.models import OuterRef, Q, Subquery

    from serving.models import InstanceEvent, ModelInstance

    last_before = (InstanceEvent.objects.filter(instance=OuterRef("pk"), at__lt=start)
                   .order_by("-at", "-pk").values("to_state")[:1])
    touched = InstanceEvent.objects.filter(at__gte=start, at__lt=end).values("instance_id")
    rows = (ModelInstance.objects.filter(Q(pk__in=ids) | Q(pk__in=touched) | Q(state="READY"))
            .annotate(state_at_start=Subquery(last_before))
            .values("pk", "model_name", "node__name", "gpus", "state", "ready_at", "state_at_start"))
    events: dict[int, list[tuple[float, str]]] = defaultdict(list)
    for iid, at, to_state in (InstanceEvent.objects.filter(at__gte=start, at__lt=end)
                              .order_by("at", "pk").values_list("instance_id", "at", "to_state")):
        events[iid].append((at.timestamp(), to_state))
    s, e = start.timestamp(), min(end.timestamp(), datetime.now(tz=UTC).timestamp())
    out = {}
    for r in rows:
        mine = events.get(r["pk"], [])
        if r["state_at_start"] is None and not mine and r["state"] == "READY" and r["ready_at"]:
            # READY with no recorded transitions (rows written by hand): READY since ready_at.
            since = max(s, r["ready_at"].timestamp())
            intervals = [(since, e)] if e > since else []
        else:
            intervals = ready_intervals(mine, start=s, end=e, ready_at_start=r["state_at_start"] == "READY")
        out[r["pk"]] = InstanceInfo(instance_id=r["pk"], model=r["model_name"], node=r["node__name"],
                                    gpus=len(r["gpus"] or []) or 1, ready=intervals)
    return out


def chargeback(*, start: datetime, end: datetime, group_by: str = "key", per_hour: bool = False,
               team_ids: set[int] | None = None) -> dict:
    """GPU-seconds over [start, end) per key, user or team (the team that owned the key when it was
    used; None: no team) and idle per instance, with each one's share of the total; `per_hour` adds
    the series per hour (for charts); `team_ids`: only what these teams' keys used while the teams
    owned them (a team lead's view: no idle list, which is every tenant's; shares stay of the whole).
    The range is widened to whole hours (busy seconds are kept per hour); READY time counts up to now."""
    from serving.models import UsageBucket
    from serving.proxy.usage import whole_buckets

    start, end = whole_buckets(start, end)

    primary = {"key": "key_id", "user": "username", "team": "team_id"}[group_by]
    # Each hour's split runs over (who, team) pairs: the split is linear in busy seconds, so folding
    # the pairs afterwards gives each key, user or team what a split by it would.
    busy: dict[tuple[int, int], dict] = defaultdict(lambda: defaultdict(float))  # (hour, instance) -> who -> s
    names: dict = {}
    for row in (UsageBucket.objects.filter(bucket_start__gte=start, bucket_start__lt=end)
                .order_by("bucket_start").values("bucket_start", "instance_id", "busy_seconds", "key_id", "key_name",
                                                 "username", "team_id", "team_slug")):
        who = (row[primary], row["team_id"])
        name = row["key_name"] if group_by == "key" else (row["team_slug"] if group_by == "team" else "")
        if name:
            names[row[primary]] = name
        busy[(int(row["bucket_start"].timestamp()), row["instance_id"])][who] += row["busy_seconds"]
    instances = _instances(start, end, {iid for _, iid in busy})
    ready: dict[tuple[int, int], float] = {}
    for known in instances.values():
        for hour, seconds in ready_by_hour(known.ready).items():
            ready[(hour, known.instance_id)] = seconds
    charged: dict = defaultdict(float)
    busy_total: dict = defaultdict(float)
    idle: dict[int, float] = defaultdict(float)
    series: dict[int, dict] = defaultdict(lambda: defaultdict(float))
    for hour, iid in sorted(set(busy) | set(ready)):
        info = instances.get(iid)
        gpus = info.gpus if info else 1
        used = busy.get((hour, iid))
        if not used:  # an hour nobody used (most of them): all idle, split_hour's answer without the call
            idle_s = max(1, gpus) * max(0.0, ready.get((hour, iid), 0.0))
            idle[iid] += idle_s
            series[hour]["(idle)"] += idle_s
            continue
        per_key, idle_s = split_hour(ready_s=ready.get((hour, iid), 0.0), gpus=gpus, busy=used)
        for who, gs in per_key.items():
            charged[who] += gs
            series[hour][who] += gs
        for who, b in used.items():
            busy_total[who] += b
        idle[iid] += idle_s
        series[hour]["(idle)"] += idle_s
    total = sum(charged.values()) + sum(idle.values())

    def share(v: float) -> float:
        return round(v / total, 6) if total > 0 else 0.0

    def kept(pair: tuple) -> bool:
        return team_ids is None or pair[1] in team_ids

    folded: dict = defaultdict(float)
    folded_busy: dict = defaultdict(float)
    for pair, gs in charged.items():
        if kept(pair):
            folded[pair[0]] += gs
            folded_busy[pair[0]] += busy_total[pair]
    items = []
    for who, gs in sorted(folded.items(), key=lambda kv: -kv[1]):
        if group_by == "key":
            item = {"key_id": who, "key_name": names.get(who, "")}
        elif group_by == "team":
            item = {"team_id": who or None, "team": names.get(who) or None}
        else:
            item = {"user": who}
        item.update(gpu_seconds=round(gs, 3), busy_seconds=round(folded_busy[who], 3), share=share(gs))
        items.append(item)
    idle_items = []
    for iid, gs in sorted(idle.items() if team_ids is None else (), key=lambda kv: -kv[1]):
        info = instances.get(iid)
        if info is None and gs <= 0:
            continue  # an instance gone from the database, with nothing to report
        idle_items.append({"instance_id": iid, "model": info.model if info else "", "node": info.node if info else "",
                           "gpus": info.gpus if info else 1, "gpu_seconds": round(gs, 3), "share": share(gs)})
    out = {"from": start, "to": end, "group_by": group_by, "total_gpu_seconds": round(total, 3), "items": items,
           "idle": idle_items}
    if per_hour:
        hours: dict[int, dict] = {}
        for h, per in sorted(series.items()):
            per_who: dict = defaultdict(float)
            for w, gs in per.items():
                if w == "(idle)":
                    if team_ids is None:
                        per_who[w] += gs
                elif kept(w):
                    per_who[w[0]] += gs
            hours[h] = dict(per_who)
        out["series"] = hours
    return out

