"""The repository stands on its own, and the layers keep to their rules."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from racer.bench.questions import DATASETS, data_dir, load_questions

SRC = Path(__file__).resolve().parents[1] / "src" / "racer"


def test_the_questions_ship_inside_the_package_and_load_with_no_shared_folder(tmp_path):
    # From a folder with nothing beside or above it, and no RACER_DATA: only the package.
    env = {k: v for k, v in os.environ.items() if k != "RACER_DATA"}
    code = ("import json; from racer.bench.questions import data_dir, load_questions; "
            "print(json.dumps([str(data_dir())] + [len(load_questions(d)) for d in "
            "('spec_bench', 'human_eval', 'mgsm')]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout
    folder, *counts = json.loads(out)
    import racer

    assert Path(folder) == Path(racer.__file__).resolve().parent / "bench" / "data"
    assert "shared" not in Path(folder).parts
    assert counts == [480, 164, 250]
    assert (Path(folder) / "README.md").read_text(encoding="utf-8").count("licence") >= 1


def test_racer_data_points_elsewhere_and_a_missing_file_is_named(tmp_path, monkeypatch):
    (tmp_path / "mgsm.jsonl").write_text('{"question_id": 1, "category": "maths", "turns": ["1 + 1?"]}\n')
    monkeypatch.setenv("RACER_DATA", str(tmp_path))
    assert data_dir() == tmp_path
    assert [q.prompt for q in load_questions("mgsm")] == ["1 + 1?"]
    with pytest.raises(ValueError, match="human_eval.*missing"):
        load_questions("human_eval")


def test_the_package_declares_its_data_files():
    text = (SRC.parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    assert "bench/data/*.jsonl" in text
    assert sorted(p.stem for p in (SRC / "bench" / "data").glob("*.jsonl")) == sorted(DATASETS)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", ["drafting", "budget"])
def test_draft_methods_and_the_budget_import_no_torch(folder):
    for path in (SRC / folder).glob("*.py"):
        bad = {name for name in _imports(path) if name.split(".")[0] in ("torch", "transformers")
               or name.startswith(("racer.engine", "racer.fastpaths.kernels", "racer.fastpaths.attention",
                                   "racer.fastpaths.kvcache"))}
        assert not bad, f"{path.name} imports {bad}"


def test_the_engine_knows_no_draft_method():
    methods = {"racer.drafting." + m for m in ("racer", "pld", "rest", "logitspec", "token_recycling",
                                              "automaton", "copy_logit", "datastore")}
    for path in (SRC / "engine").glob("*.py"):
        assert not (_imports(path) & methods), path.name


def test_every_device_to_host_copy_goes_through_one_helper():
    # On an accelerator each read waits for the device: ``racer.engine.host`` is the only
    # place that reads, so a step's reads can be counted (and kept to one).
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).as_posix() == "engine/host.py":
            continue
        text = path.read_text(encoding="utf-8")
        for call in (".cpu()", ".numpy()", ".item()", "torch.cuda.synchronize"):
            assert call not in text, f"{path.relative_to(SRC)} calls {call}: use racer.engine.host"


def test_the_server_calls_only_the_public_api():
    inner = ("racer.engine", "racer.drafting", "racer.budget", "racer.fastpaths", "racer.bench")
    for path in (SRC / "serve").glob("*.py"):
        bad = {name for name in _imports(path) if name.startswith(inner) or name.split(".")[0] == "torch"}
        assert not bad, f"serve/{path.name} imports {bad}"
    assert "fastapi" not in _imports(SRC / "serve" / "protocol.py")  # the protocol is plain Python


def test_every_folder_states_its_rule():
    for folder in ("drafting", "budget", "engine", "fastpaths", "bench", "serve"):
        doc = ast.get_docstring(ast.parse((SRC / folder / "__init__.py").read_text(encoding="utf-8")))
        rule = doc.splitlines()[0]
        assert rule.endswith(".") and len(rule) <= 100, folder


def test_the_models_facts_are_worked_out_in_one_module():
    # Device, dtype, context window and vocabulary (through the text config) come from
    # ``racer.engine.model_facts``; worked out again elsewhere, they drift apart.
    import re

    reads = re.compile(r"\.parameters\(\)\)|[.\"']max_position_embeddings\b|\.vocab_size\b|get_text_config")
    for path in SRC.rglob("*.py"):
        if path.name == "model_facts.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#")[0]
            assert not reads.search(code) or "facts.vocab_size" in code, f"{path.relative_to(SRC)}:{number}: {line.strip()}"


def test_no_module_hides_a_name_its_package_hands_on():
    # A submodule named like a function its package's __init__ exports replaces that
    # function on the package once anything imports the submodule.
    for init in SRC.rglob("__init__.py"):
        tree = ast.parse(init.read_text(encoding="utf-8"))
        exported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    for alias in node.names}
        modules = {path.stem for path in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir() if p.is_dir()}
        assert not exported & modules - {"__init__"}, f"{init.parent.name}: {exported & modules}"


# Each layer imports only layers below it: data flows one way, and a lower layer can be
# used (and tested) without the ones above. "racer" is the package's public API, which
# the edges (the benchmark, the chat, the server, integrations) call.
LAYERS = {"drafting": 0, "fastpaths": 0, "loading": 0, "budget": 1, "engine": 2, "racer": 3, "bench": 4,
          "chat": 4, "serve": 4, "integrations": 4, "hf": 4, "cli": 5}


def _layer(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else ("racer" if rel.stem == "__init__" else rel.stem)


def test_no_layer_imports_one_above_it():
    for path in SRC.rglob("*.py"):
        own = _layer(path)
        assert own in LAYERS, f"{path.relative_to(SRC)}: a layer the rule does not name"
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "racer":
                continue
            target = parts[1] if len(parts) > 1 else "racer"
            if target != own:
                assert LAYERS[target] < LAYERS[own], f"{path.relative_to(SRC)} ({own}) imports {name} ({target})"


def test_the_decoder_is_a_front_over_the_one_engine():
    # One decoding loop: the single-request front keeps no loop of its own.
    text = (SRC / "engine" / "decoder.py").read_text(encoding="utf-8")
    for word in ("verify(", "draft(", "observe(", "commit(", "prefill("):
        assert word not in text, f"engine/decoder.py calls {word}"
