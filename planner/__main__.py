"""CLI: `python -m planner estimate CASE.json` and `python -m planner search CASE.json [--top K]`.

Prints one JSON object on stdout. An estimate carries `assumptions`: each recipe field the case left null, the
value the planner took and what the same layout's step takes with each other value (planner.api.assumptions),
and `step_time_band_s`, the fastest and slowest of those steps. Bad input (malformed JSON, a missing or unknown
field, an unknown chip, sizes that do not divide, a search that finds nothing that fits) exits with status 2 and a
message on stderr that names the field; an estimate of a layout that does not fit is an answer (`"fits": false`,
status 0).
"""

from __future__ import annotations

import argparse
import sys

from core.stdout import EXIT_BAD_INPUT, write_result
from core.timeline import unwritable_reason
from planner.api import assumptions, dumps, estimate, no_fit_error, search, step_time_band_s
from planner.case import load_case
from planner.models import SpecError

MAX_TOP = 100  # the most layouts `search --top` ranks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planner", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    est = sub.add_parser("estimate", help="step time, MFU, memory per chip of one case")
    est.add_argument("case", help="case JSON file (null fields are chosen)")
    est.add_argument("--timeline", metavar="PATH",
                     help="also write the predicted timeline (Chrome trace JSON)")
    sea = sub.add_parser("search", help="rank the layouts of the case's null fields")
    sea.add_argument("case", help="case JSON file")
    sea.add_argument("--top", type=int, default=5, help="how many layouts to print (default 5, at most 100)")
    args = parser.parse_args(argv)
    try:
        case = load_case(args.case)
        reason = (args.command == "estimate" and args.timeline is not None
                  and unwritable_reason(args.timeline, inputs=(args.case,)))
        if reason:
            raise SpecError("--timeline", reason)
        if args.command == "estimate":
            result = estimate(case)
            found = assumptions(case, result)
            # the result first, as engine run does: a stdout that cannot be written (exit 2) leaves no trace
            # behind, and a trace that cannot be written loses nothing else
            write_result(dumps({**result.as_dict(), "assumptions": [a.as_dict() for a in found],
                                "step_time_band_s": step_time_band_s(result, found)}))
            if args.timeline:
                try:
                    result.timeline.write_chrome_trace(args.timeline)
                except OSError as e:
                    raise SpecError("--timeline",
                                    f"cannot write {args.timeline}: {e.strerror}; choose another path") from None
        else:
            if not 1 <= args.top <= MAX_TOP:
                raise SpecError("--top", f"must be 1 to {MAX_TOP}, got {args.top} (each ranked layout is simulated "
                                "pass by pass; more than a hundred take minutes and say nothing the first hundred "
                                "do not)")
            report = search(case, top=args.top)
            if not report.ranked:
                raise no_fit_error(case, report)
            write_result(dumps(report.as_dict()))
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
