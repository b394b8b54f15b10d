"""The config reference (archer/config/reference.py, the docs site's docs/config_reference.md): the YAML's comments
read as it writes them, every key of ppo_trainer.yaml with its default and type, and archer's no-ops marked."""

from __future__ import annotations

from pathlib import Path

from archer.config.loader import known_keys
from archer.config.no_ops import NO_OPS
from archer.config.reference import key_comments, key_docs, reference_markdown

YAML = """\
# a header, not a key's

top:                    # the section
  count: 3              # how many, and this comment
                        # goes on below it
  # the block above a key
  name: "a # b"         # the quoted # is no comment
  plain: 1
# a comment at the left edge, then a key of the section below it
  after: x
"""


def test_comments_are_read_as_the_yaml_writes_them() -> None:
    assert key_comments(YAML) == {
        "top": "the section",
        "top.count": "how many, and this comment goes on below it",
        "top.name": "the block above a key the quoted # is no comment",
        "top.plain": "",
        "top.after": "a comment at the left edge, then a key of the section below it",
    }


def test_a_small_yaml_becomes_its_rows(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(YAML)
    rows = {d.key: (d.default, d.kind, d.section) for d in key_docs(tmp_path / "c.yaml")}
    assert rows == {"top": ("", "section", True), "top.count": ("3", "int", False),
                    "top.name": ("a # b", "string", False), "top.plain": ("1", "int", False),
                    "top.after": ("x", "string", False)}
    page = reference_markdown(tmp_path / "c.yaml")
    assert "| `top.count` | `3` | int | yes | how many, and this comment goes on below it |" in page
    assert "## `top`\n\nthe section\n" in page


def test_every_key_of_ppo_trainer_has_its_row() -> None:
    docs = {d.key: d for d in key_docs()}
    assert set(docs) == known_keys("ppo_trainer")[0]
    page = reference_markdown()
    for d in docs.values():
        assert f"| `{d.key}` |" in page or (d.section and f"## `{d.key}`" in page), d.key
    # rows by hand: a comment continued on the lines below, a required key, a list key with a null default, a key
    # that follows another, a free-form mapping
    train_files = docs["data.train_files"]
    assert (train_files.default, train_files.kind, train_files.comment) == (
        "null", "any (null: unset)",
        "a parquet / .json / .jsonl path or a list of them (verl schema); a file with no rows is an error; "
        "required unless trainer.val_only")
    path = docs["actor_rollout_ref.model.path"]
    assert (path.default, path.kind) == ("???", "required")
    assert docs["trainer.influence_trace.layers"].kind == "list"
    assert docs["trainer.logger"].default == "[console, jsonl, tensorboard]"
    follows = docs["actor_rollout_ref.ref.log_prob_use_dynamic_bsz"]
    assert follows.kind == "as `actor_rollout_ref.actor.use_dynamic_bsz`"
    assert docs["data.apply_chat_template_kwargs"].kind == "mapping (any keys)"
    assert ("| `data.truncation` | `error` | string | yes | error \\| left \\| right \\| middle |") in page


def test_the_keys_archer_does_not_act_on_say_so() -> None:
    docs = {d.key: d for d in key_docs()}
    page = reference_markdown()
    schema = [entry for entry in NO_OPS if entry.in_schema]
    assert schema and all(docs[entry.key].no_op == entry for entry in schema)
    assert sum(d.no_op is not None for d in docs.values()) == len(schema)
    assert ("| `data.dataloader_num_workers` | `8` | int | no: prompts are collated in the trainer's process |"
            in page)
    assert "| `actor_rollout_ref.ref.fsdp_config.param_offload` | `false` | bool | only with several ranks: " in page
    assert "| `data.train_batch_size` | `1024` | int | yes | prompts per step |" in page
