"""What a dcut run did and why, in numbers: the summary python -m minidcut.generate prints under its table.

Per bucket the run stepped at, as the batch drained: its steps, how many drafted and which rho each
chose. For the bucket the run spent most steps at: what the cost table says a drafting step costs there
in AR steps (the tokens per request it must commit to pay), what the drafting steps were predicted to
accept against what they did, and whether drafting is now on or off there, with its scores.
"""

from __future__ import annotations

import math

from .dcut import budget
from .skipping import CONFIDENCE
from .stats import Stats


def explain(stats: Stats, policy, table_file=None) -> list[str]:
    """Plain lines (no markup) for a finished run of `policy`; none for a policy without a cost table."""
    if policy.table is None or not stats.bucket_hist:
        return []
    b = max(stats.bucket_hist, key=stats.bucket_hist.get)
    lines = ["rho per step: " + ", ".join(f"{rho:g} on {n} of {stats.steps}" for rho, n in sorted(stats.rho_hist.items()))
             + f" (rho 0: an AR step; the run spent {stats.bucket_hist[b]} steps at bucket {b})"]
    for bucket in sorted(stats.bucket_hist, reverse=True):
        n = stats.bucket_hist[bucket]
        drafted = {rho: k for (bb, rho), k in stats.rho_by_bucket.items() if bb == bucket and rho is not None}
        chose = ", ".join(f"rho {rho:g} on {k}" for rho, k in sorted(drafted.items()))
        lines.append(f"bucket {bucket}: {n} steps, {sum(drafted.values())} drafting" + (f" ({chose})" if chose else ""))
    costs = policy.costs(b)
    if costs is None:
        return lines
    ar = costs[0] if policy.rhos[0] == 0.0 else None
    parts = [f"rho {r:g}: {budget(r, b, policy.depth)} drafts ({budget(r, b, policy.depth) / b:g} per request), "
             f"{c / ar:.1f} AR steps" for r, c in zip(policy.rhos, costs) if r > 0 and not math.isinf(c)] if ar else []
    if ar is not None and parts:
        steps = sum(policy.table.samples[policy.table.batch_sizes.index(b)])
        lines.append(f"cost table at bucket {b} ({steps} steps behind it): an AR step {1e3 * ar:.1f} ms; a drafting "
                     "step verifying " + "; ".join(parts)
                     + " (a request must commit that many tokens per step for it to pay)")
    cut = [f"{r:g}" for r, c in zip(policy.rhos, costs) if math.isinf(c)]
    if cut:
        lines.append(f"rho {', '.join(cut)} not measured at bucket {b}: its cost could not beat a smaller budget")
    n = stats.drafting_request_steps
    if n:
        lines.append(f"drafting steps ({sum(stats.drafting_hist.values())}): predicted {stats.predicted / n:.2f} "
                     f"accepted drafts per request (calibrated; raw confidences {stats.predicted_raw / n:.2f}), "
                     f"realized {stats.realized / n:.2f}: {1 + stats.realized / n:.2f} tokens per request per step")
    skip = policy.skipping.get(b)
    if skip is not None:
        if not skip.possible:
            lines.append(f"drafting never runs at bucket {b}: even if every kept draft were accepted, no rho "
                         "commits more per second than an AR step")
        elif skip.state == "off":
            cheapest = min(c for r, c in skip.cost.items() if r > 0) / skip.cost[0.0]
            probes = skip.scores
            lines.append(f"drafting is off at bucket {b}: its steps committed fewer tokens per second than AR "
                         f"steps ({CONFIDENCE:.0%} sure), where the cheapest costs {cheapest:.1f} AR steps; a probe "
                         f"checks again after {skip.probe_period()} AR steps or more (the more drafter context it "
                         "must catch up, the later)" + (f"; the probes since score {probes.mean:+.2f} tokens per "
                                                        "request per step over AR steps" if probes.n else ""))
        else:
            ev = skip.scores
            lines.append(f"drafting is on at bucket {b}" + (
                f": its steps score {ev.mean:+.2f} tokens per request per step over AR steps (~{ev.n:.0f} "
                f"steps), not {CONFIDENCE:.0%} sure it loses" if ev.n >= 1.5 else ""))
    for bucket, left in sorted(stats.unmeasured.items()):
        lines.append(f"bucket {bucket} ran AR steps without a cost row: its rows had at most {left} steps left, "
                     "fewer AR steps' time than measuring its row takes")
    if stats.seconds["profile"]:
        lines.append(f"measured missing cost-table rows in {stats.seconds['profile']:.1f} s (not counted in tok/s)")
    if table_file is not None:
        lines.append(f"cost table and what the policy learned: {table_file} (the next run starts from it)")
    return lines
