"""Run tinker-cookbook 0.6.1's RL loop, unmodified, against the Tinker server at TINKER_BASE_URL
(key: TINKER_API_KEY), from the cookbook's own environment (`make cookbook`):

    .venv-cookbook/bin/python tests/integration/cookbook/rl_run.py MODEL_FOLDER OUT_FOLDER

MODEL_FOLDER is a local Hugging Face model folder: its path is the model name the server is asked
for and where the cookbook loads the tokenizer from. The environment is the cookbook's synthetic
arithmetic one (recipes/math_rl/arithmetic_env.py), rendered with the generic `role_colon`
renderer, trained with the `importance_sampling` loss in the synchronous loop. Logs and
checkpoints.jsonl go to OUT_FOLDER/rl. `--build-only` builds the dataset and the first
observation and exits without contacting the server. Prints one JSON line: the steps trained and
the checkpoints saved.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from common import RENDERER, arguments, no_pricing_download, report  # sets up offline use first


def build_config(model: str, log_path: Path, steps: int, save_every: int):
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    dataset = ArithmeticDatasetBuilder(
        batch_size=2,  # groups per step
        group_size=2,  # rollouts per problem
        n_batches=steps,
        model_name_for_tokenizer=model,
        renderer_name=RENDERER,
        include_fewshot=True,
    )
    return train.Config(
        log_path=str(log_path),
        model_name=model,
        recipe_name="mint_cookbook_rl",
        renderer_name=RENDERER,
        dataset_builder=dataset,
        learning_rate=1e-4,
        lora_rank=8,
        max_tokens=8,  # answers are a number; the few-shot prompt is ~70 byte tokens
        loss_fn="importance_sampling",
        max_steps=steps,
        save_every=save_every,  # periodic save_state + save_weights_for_sampler; final always
        eval_every=0,
        wandb_project=None,
    )


async def build_only(config) -> dict:
    dataset, _ = await config.dataset_builder()
    builder = dataset.get_batch(0)[0]
    env = (await builder.make_envs())[0]
    observation, stop = await env.initial_observation()
    return {
        "loop": "rl",
        "batches": len(dataset),
        "prompt_tokens": observation.length,
        "stop": stop,
    }


def main() -> None:
    args = arguments(__doc__)
    model = str(args.model.resolve())
    log_path = args.out.resolve() / "rl"
    config = build_config(model, log_path, args.steps, args.save_every)
    if args.build_only:
        print(json.dumps(asyncio.run(build_only(config))))
        return
    from tinker_cookbook.rl import train

    no_pricing_download()
    asyncio.run(train.main(config))
    print(json.dumps(report(log_path, "rl", "progress/batch")))


if __name__ == "__main__":
    main()
