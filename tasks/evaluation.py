"""The evaluation gate as a step: the candidate and `production` scored on the same rows,
through a worker of their base (`mint_core.planning.evaluation` chooses the rows and judges)."""

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from mint_core.artifacts.stores import open_store, read_data
from mint_core.config import MintConfig
from mint_core.errors import NotFoundError, RejectedError
from mint_core.gates import Gates
from mint_core.model.datasets import located, parse_jsonl
from mint_core.planning.evaluation import (
    EVAL_GENERATION_ROWS,
    EVAL_ROWS_TAG,
    TRAIN_ROWS_TAG,
    Evaluation,
    Generate,
    Rows,
    SetScore,
    choose_eval_sets,
    exact_match,
    load_digests,
    load_rows,
)
from mint_core.registry import Registry
from mint_core.revisions import RevisionId, RevisionRef
from tasks.fleet import Fleet, fleet_for
from tasks.runs import run_log


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_revision(
    config: MintConfig,
    revision: RevisionId,
    gates: Gates,
    actor: str = "mint",
    fleet: Fleet | None = None,
) -> Evaluation | None:
    """Score `revision` and the revision serving `production` on the same rows, through one
    worker of their base: the eval set (the gates' `eval_data`, else production's held-out
    rows, else the candidate's own) and the gates' `regression_data`. Both scores go on the
    candidate's model version and into a Prefect table artifact `eval-<adapter>`. RejectedError
    (stage `rejected`) when the candidate falls behind by more than `gates.max_regression` on
    any set. None, noted in the stage history, when there is nothing to compare: no
    production revision (training already scored a first revision on its held-out rows) or
    no rows."""
    registry = Registry(config.tracking_uri)
    try:
        production = registry.revisions.resolve(RevisionRef(revision.adapter)).id
    except NotFoundError:
        production = None
    if production in (None, revision):
        registry.stages.note(revision, actor, "evaluation passed: no other revision in production")
        run_log().info("%s evaluation passed: no other revision in production", revision)
        return None
    store = open_store(config)
    staging = config.work_root / "eval-rows"
    tags = {holder: registry.revisions.get(holder).tags for holder in (revision, production)}

    def read(where: str) -> Rows:
        return parse_jsonl(read_data(config, where), located(where)).rows

    def stored(holder: RevisionId) -> Rows | None:
        """The held-out rows `holder` was trained with; None for an imported adapter."""
        name = tags[holder].get(EVAL_ROWS_TAG)
        return None if name is None else load_rows(store, staging, name, holder)

    def trained(holder: RevisionId) -> frozenset[str] | None:
        """The digests of the rows `holder` was trained on; None where they are not recorded."""
        name = tags[holder].get(TRAIN_ROWS_TAG)
        return None if name is None else load_digests(store, staging, name, holder)

    training_rows = {holder: trained(holder) for holder in tags}
    sets = choose_eval_sets(
        gates, revision, production, read, stored, training_rows, EVAL_GENERATION_ROWS
    )
    if not sets:
        registry.stages.note(
            revision,
            actor,
            f"evaluation passed: no rows to score {revision} and {production} on (neither has "
            "held-out rows, and the adapter's gates name no eval_data)",
        )
        run_log().info("%s evaluation passed: no rows to score it and %s on", revision, production)
        return None
    worker = fleet_for(config, revision, fleet).workers[0]

    def served(which: RevisionId) -> Generate:
        return lambda prompts, budget: worker.greedy_texts(str(which), prompts, budget)

    scores = tuple(
        SetScore(
            name,
            len(chosen.rows),
            exact_match(chosen.rows, served(revision)),
            exact_match(chosen.rows, served(production)),
            chosen.source,
            chosen.excluded,
        )
        for name, chosen in sets.items()
    )
    unrecorded = tuple(holder for holder, digests in training_rows.items() if digests is None)
    evaluation = Evaluation(revision, production, scores, gates.max_regression, unrecorded)
    for key, value in evaluation.tags().items():
        registry.revisions.set_tag(revision, key, value)
    create_table_artifact(
        evaluation.table(), key=f"eval-{revision.adapter}", description=evaluation.reason()
    )
    if not evaluation.passed:
        registry.aliases.reject(revision, actor, evaluation.reason())
        run_log().warning("%s %s", revision, evaluation.reason())
        raise RejectedError(f"{evaluation.reason()}; production did not move")
    registry.stages.note(revision, actor, evaluation.reason())
    run_log().info("%s %s", revision, evaluation.reason())
    return evaluation
