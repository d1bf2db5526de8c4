"""Run tinker-cookbook 0.6.1's supervised loop, unmodified, against the Tinker server at
TINKER_BASE_URL (key: TINKER_API_KEY), from the cookbook's own environment (`make cookbook`):

    .venv-cookbook/bin/python tests/integration/cookbook/sl_run.py MODEL_FOLDER OUT_FOLDER

MODEL_FOLDER is a local Hugging Face model folder: its path is the model name the server is asked
for and where the cookbook loads the tokenizer from. The data are the conversations the cookbook
ships, through its own jsonl chat builder and the generic `role_colon` renderer. Logs and
checkpoints.jsonl go to OUT_FOLDER/sl. `--build-only` builds the dataset and exits without
contacting the server. Prints one JSON line: the steps trained and the checkpoints saved.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from common import RENDERER, arguments, no_pricing_download, report  # sets up offline use first


def build_config(model: str, log_path: Path, steps: int, save_every: int):
    from importlib.resources import files

    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    conversations = files("tinker_cookbook") / "example_data" / "conversations.jsonl"
    dataset = FromConversationFileBuilder(
        file_path=str(conversations),
        test_size=0,  # no held-out set, so no sampler NLL evaluator
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=model,
            renderer_name=RENDERER,
            max_length=128,  # the embedded tiny base's context; longer examples are cut
            batch_size=4,
        ),
    )
    return train.Config(
        log_path=str(log_path),
        model_name=model,
        recipe_name="mint_cookbook_sl",
        renderer_name=RENDERER,
        dataset_builder=dataset,
        learning_rate=1e-4,
        lora_rank=8,
        max_steps=steps,
        save_every=save_every,  # periodic save_state + save_weights_for_sampler; final always
        eval_every=0,
        infrequent_eval_every=0,
        wandb_project=None,
    )


def main() -> None:
    args = arguments(__doc__)
    model = str(args.model.resolve())
    log_path = args.out.resolve() / "sl"
    config = build_config(model, log_path, args.steps, args.save_every)
    if args.build_only:
        dataset, _ = config.dataset_builder()
        batch = dataset.get_batch(0)
        print(
            json.dumps(
                {
                    "loop": "supervised",
                    "batches": len(dataset),
                    "batch_size": len(batch),
                    "tokens": [d.model_input.length for d in batch],
                }
            )
        )
        return
    from tinker_cookbook.supervised import train

    no_pricing_download()
    asyncio.run(train.main(config))
    print(json.dumps(report(log_path, "supervised", "train_mean_nll")))


if __name__ == "__main__":
    main()
