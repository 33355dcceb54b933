"""`dflash-trt init-drafter` on the tiny target: its --target-layer-ids rules are train-drafter's."""

from click.testing import CliRunner

from tests.training.conftest import MASK
from dflash_trt.cli import cli
from dflash_trt.errors import ConfigError


def test_init_drafter_checks_layer_ids_as_train_drafter_does(tmp_path, target_with_tokenizer):
    """init-drafter parses --target-layer-ids with train-drafter's rules (it accepted repeats, ids past
    the target's layers and an empty list); its summary counts layers in the singular too."""
    def init(*extra):
        return CliRunner().invoke(cli, ["init-drafter", "--target", str(target_with_tokenizer), "--out",
                                        str(tmp_path / "d"), "--num-layers", "1", "--mask-token-id", str(MASK), *extra])

    for ids, msg in (("3,1,3", "[3] given more than once"), ("0,4", "[4] outside [0, 3]"), ("", "is empty")):
        res = init("--target-layer-ids", ids)
        assert isinstance(res.exception, ConfigError) and msg in str(res.exception), repr(res.exception)
    assert not (tmp_path / "d").exists()
    res = init("--target-layer-ids", "0,2")
    assert res.exit_code == 0 and "wrote untrained drafter (1 layer, block 16, target layers [0, 2]" in res.output, res.output


def test_init_drafter_never_replaces_a_file(tmp_path, target_with_tokenizer):
    """A file at --out stays, even with --force (it used to become a drafter folder)."""
    f = tmp_path / "notes.jsonl"
    f.write_text("keep me")
    res = CliRunner().invoke(cli, ["init-drafter", "--target", str(target_with_tokenizer), "--out", str(f), "--force",
                                   "--mask-token-id", str(MASK), "--target-layer-ids", "0,2"])
    assert isinstance(res.exception, ConfigError) and f"--out {f} is a file" in str(res.exception), repr(res.exception)
    assert f.read_text() == "keep me"


def test_a_drafter_given_as_target_names_the_flag_init_drafter_has(tmp_path):
    """A drafter folder as --target: the fix names --target only (init-drafter has no --drafter)."""
    from dflash_trt.models.default import default_drafter_path

    res = CliRunner().invoke(cli, ["init-drafter", "--target", str(default_drafter_path()), "--out", str(tmp_path / "d")])
    assert isinstance(res.exception, ConfigError) and str(res.exception) == (
        "this config.json is a DFlash drafter's (DFlashDraftModel), not a target model's: give the target model's "
        "folder as --target"), repr(res.exception)
    assert not (tmp_path / "d").exists()


def test_the_default_layer_ids_of_a_shallow_target_are_distinct(tmp_path, target_with_tokenizer):
    """Without --target-layer-ids, the 4-layer tiny target gets each default layer once ([1], not
    z-lab's [1, 1, 1, 1, 1], which --target-layer-ids would refuse)."""
    res = CliRunner().invoke(cli, ["init-drafter", "--target", str(target_with_tokenizer), "--out",
                                   str(tmp_path / "d"), "--mask-token-id", str(MASK)])
    assert res.exit_code == 0 and "target layers [1], " in res.output, res.output + repr(res.exception)
