"""Does a drafter fit a target? Every check names the mismatch and the fix.

Used by the runtime before it loads weights, by `dflash-trt check` and by `dflash-trt build`.
"""

from __future__ import annotations

from dflash_trt.config import DrafterConfig, TargetConfig
from dflash_trt.errors import IncompatibleModelsError


def compatibility_problems(target: TargetConfig, drafter: DrafterConfig) -> list[str]:
    """All reasons `drafter` cannot serve `target` (empty list when it can)."""
    problems = []
    if drafter.vocab_size != target.vocab_size:
        problems.append(
            f"vocab size: drafter {drafter.vocab_size} != target {target.vocab_size}; the drafter shares the "
            "target's embedding and lm_head, so it must be trained for this target's tokenizer"
        )
    if drafter.hidden_size != target.hidden_size:
        problems.append(
            f"hidden size: drafter {drafter.hidden_size} != target {target.hidden_size}; the drafter reads the "
            "target's token embeddings, so its hidden_size must equal the target's"
        )
    n = target.num_hidden_layers
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < n]
    if bad:
        problems.append(
            f"target_layer_ids {list(drafter.target_layer_ids)}: {bad} outside [0, {n - 1}] (the target has {n} layers); "
            "set dflash_config.target_layer_ids to layers of this target"
        )
    if drafter.target_hidden_size != target.hidden_size:
        problems.append(
            f"fc width: fc expects {drafter.fc_in_features} = {len(drafter.target_layer_ids)} x {drafter.target_hidden_size} "
            f"input features, but {len(drafter.target_layer_ids)} target layers of hidden size {target.hidden_size} give "
            f"{len(drafter.target_layer_ids) * target.hidden_size}"
        )
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        problems.append(
            f"mask_token_id {drafter.mask_token_id} is outside the target vocabulary [0, {target.vocab_size}); "
            "pick a reserved token id of the target's tokenizer"
        )
    if drafter.num_target_layers and drafter.num_target_layers != n:
        problems.append(
            f"num_target_layers: the drafter was made for a target with {drafter.num_target_layers} layers, this "
            f"target has {n}; use the drafter trained for this target"
        )
    if drafter.draft_vocab_size is not None and not 1 <= drafter.draft_vocab_size <= target.vocab_size:
        problems.append(f"draft_vocab_size {drafter.draft_vocab_size} outside [1, {target.vocab_size}]")
    if drafter.block_size < 2:
        problems.append(f"block_size {drafter.block_size} < 2: a block must hold the last token and at least one mask")
    return problems


def check_compatible(target: TargetConfig, drafter: DrafterConfig) -> None:
    """Raise IncompatibleModelsError listing every problem, or return None."""
    problems = compatibility_problems(target, drafter)
    if problems:
        raise IncompatibleModelsError("drafter does not fit the target:\n  - " + "\n  - ".join(problems))
