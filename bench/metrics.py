"""What metrics cost: the service step with ``--metrics-port`` on against off, same run.

    .venv/bin/python -m bench.metrics            # ~100M float32 params (6 x 4096 x 4096), 2 shards
    .venv/bin/python -m bench.metrics --small    # 4 x 512 x 512, a quick smoke run

Two servers side by side (:mod:`bench._ab`): one exports no metrics (its shards record nothing),
the other serves /metrics (every push, pull and update is recorded); nothing scrapes during the run.
"""

from __future__ import annotations


from bench._ab import compare, parse_arguments


def main(argv=None) -> str:
    args = parse_arguments(__doc__.splitlines()[0], argv)
    return compare("bench.metrics", {"metrics off": ({}, {}), "metrics on": ({"metrics_port": 0}, {})},
                   small=args.small, shards=args.shards, repeats=args.repeats)


if __name__ == "__main__":
    main()
