"""Parses a Prometheus text exposition from stdin with prometheus_client's parser.

Prints a JSON object {"families": {name: type}, "samples": {"name{k=v,...}": value}} so
the Rust test can assert exact values. Exits non-zero if the text does not parse.
"""

import json
import sys

from prometheus_client.parser import text_string_to_metric_families


def main() -> None:
    text = sys.stdin.read()
    families = {}
    samples = {}
    for fam in text_string_to_metric_families(text):
        families[fam.name] = fam.type
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    json.dump({"families": families, "samples": samples}, sys.stdout)


if __name__ == "__main__":
    main()
