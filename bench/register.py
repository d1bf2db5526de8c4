"""Register benchmark: the register step alone (artifacts already exported) against a real
`mlflow server` on loopback, over many revisions; median, p95 and the ratio to the reference
system's 1.66 s. Writes bench/results/register.json.

    .venv/bin/python bench/register.py                  # 60 revisions over 6 adapters
    .venv/bin/python bench/register.py --revisions 5    # a smoke run
"""

import os
import statistics
import sys
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from bench import harness
from control.services import start_mlflow
from mint_core.artifacts.digests import sha256_json
from mint_core.registry import Registry
from mint_core.revisions import PolicyRecord

REFERENCE_S = 1.66
BASE_DIGEST = sha256_json("bench-base")


def policy(adapter: str, number: int) -> PolicyRecord:
    return PolicyRecord(
        adapter=adapter,
        content_digest=sha256_json([adapter, number]),
        base_model_id="mint-tiny-llama-bench",
        base_digest=BASE_DIGEST,
        training_steps=400,
        dataset_digest=sha256_json(["data", number]),
        lora_rank=8,
        lora_alpha=16,
        target_modules=("q_proj", "v_proj"),
        created_by="bench",
        created_at=datetime.now(UTC).isoformat(),
        dataset="/data/bench.jsonl",
        parent_revision=number - 1 if number > 1 else None,
        eval_metrics={"eval_loss": 0.1, "eval_exact_match": 0.9},
    )


def main() -> None:
    parser = harness.command_line(__doc__, "register")
    parser.add_argument("--revisions", type=int, default=60, help="revisions to register")
    parser.add_argument("--adapters", type=int, default=6, help="adapters they are spread over")
    args = parser.parse_args()

    with harness.scratch("register") as (home, services):
        server = start_mlflow(home)
        services.append(server)
        registry = Registry(server.url)
        registry.register(policy("warm-up", 1), "mint-local://sha256/" + "0" * 64, BASE_DIGEST)
        times = []
        for n in range(args.revisions):
            adapter = f"bench-{n % args.adapters}"
            record = policy(adapter, n // args.adapters + 1)
            uri = "mint-local://sha256/" + record.content_digest.removeprefix("sha256:")
            times.append(harness.seconds(partial(registry.register, record, uri, BASE_DIGEST)))

    p50 = statistics.median(times)
    p95 = statistics.quantiles(times, n=20)[-1] if len(times) >= 2 else times[0]
    print(f"register over {len(times)} revisions ({args.adapters} adapters), real mlflow server:")
    print(f"  p50 {p50 * 1e3:.0f} ms   p95 {p95 * 1e3:.0f} ms   "
          f"reference {REFERENCE_S:.2f} s -> {REFERENCE_S / p50:.1f}x faster at p50")  # fmt: skip
    result = {
        "revisions": len(times),
        "adapters": args.adapters,
        "register_p50_s": p50,
        "register_p95_s": p95,
        "reference_s": REFERENCE_S,
        "reference_over_p50": REFERENCE_S / p50,
        "samples_s": times,
    }
    harness.write(args.out, result)


if __name__ == "__main__":
    main()
