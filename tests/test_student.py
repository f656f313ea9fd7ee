"""The linearized student in HF models: swapping layers, save/load, the dims it is built with."""

import pytest
import torch

from dofattn.spec import Attention
from dofattn.errors import UserError
from dofattn.spec import StudentSpec
from dofattn.distill.choose import resolve_dims
from dofattn.model.attach import bounded_of, linear_of
from dofattn.model.student import (attach_student, attention_modules, fingerprint, linearize,
                             load_student, read_spec, save_student)
from tests.conftest import tiny_model

FAMILIES = ["llama", "gpt2", "gpt_neox"]


def ids(batch=2, length=19, seed=0):
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- swapping layers -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_nothing_swapped_gives_stock_logits(family):
    model = tiny_model(family)
    x = ids()
    stock = model(x, use_cache=False).logits
    linearize(model, [8, 8, 8], Attention(window=0, sink=0), layers=[])
    assert model.config._attn_implementation == "dofattn"
    assert torch.equal(model(x, use_cache=False).logits, stock)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_layer_swap_changes_only_that_layer(family):
    teacher, student = tiny_model(family), tiny_model(family)
    linearize(student, [8, 8, 8], Attention(window=0, sink=0), layers=[1])
    x = ids()
    with torch.no_grad():
        ref = teacher(x, output_hidden_states=True, use_cache=False).hidden_states
        got = student(x, output_hidden_states=True, use_cache=False).hidden_states
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])  # embeddings, after layer 0
    assert not torch.allclose(ref[2], got[2])
    assert [hasattr(m, "dofattn") for m in attention_modules(student)] == [False, True, False]


@pytest.mark.parametrize("family", FAMILIES)
def test_taking_the_linear_part_off_gives_the_layer_softmax_back(family):
    whole, partial = tiny_model(family), tiny_model(family)
    linearize(whole, [8, 8, 8], Attention(window=0, sink=0))
    linearize(partial, [8, 8, 8], Attention(window=0, sink=0), layers=[0, 2])
    del attention_modules(whole)[1].dofattn            # e.g. experiments/layer_sensitivity.py
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(whole(x, use_cache=False).logits, partial(x, use_cache=False).logits)
        got = whole.generate(x, max_new_tokens=5, do_sample=False)
        assert torch.equal(got, partial.generate(x, max_new_tokens=5, do_sample=False))


# --- save / load -----------------------------------------------------------------------------------------------

def make_student(family, tmp_path, model_dirs, feature="prf"):
    model = tiny_model(family)
    dims = resolve_dims([5, 12, 7], model)
    linearize(model, dims, Attention(feature=feature, window=0, sink=0), seed=4)
    with torch.no_grad():  # make the features differ from a fresh init
        for name, p in model.named_parameters():
            if ".dofattn." in name:
                p.add_(0.01 * torch.randn_like(p))
        model(ids(1, 8), use_cache=False)  # calibrates key shifts
    config = StudentSpec(base_model=str(model_dirs[family]), dims=dims, layers=[0, 1, 2], seed=4,
                         base=fingerprint(model), attention=Attention(feature=feature, window=0, sink=0))
    folder = save_student(model, tmp_path / f"student-{family}", config)
    return model, folder


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_round_trip_is_exact(family, tmp_path, model_dirs):
    from dofattn.model.hf import load_model

    base, _ = load_model(str(model_dirs[family]))
    model = tiny_model(family)
    assert torch.equal(base.get_input_embeddings().weight, model.get_input_embeddings().weight)
    model, folder = make_student(family, tmp_path, model_dirs)
    loaded, tokenizer, config = load_student(folder)
    assert config.dims == (5, 12, 7) and config.dofattn_version and config.schema == 4
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x, use_cache=False).logits, loaded(x, use_cache=False).logits)
    assert sorted(p.name for p in folder.iterdir()) == ["dofattn.json", "features.safetensors"]   # no staging


def test_load_errors(tmp_path, model_dirs):
    model, folder = make_student("llama", tmp_path, model_dirs)
    other = tiny_model("llama", seed=9)  # same shapes, other weights
    with pytest.raises(UserError, match="does not fit this model.*embedding_norm"):
        attach_student(other, folder)
    with pytest.raises(UserError, match="does not fit this model"):
        attach_student(tiny_model("gpt2"), folder)
    (folder / "features.safetensors").unlink()
    with pytest.raises(UserError, match="features.safetensors is missing"):
        read_spec(folder)


def test_resolve_dims(tmp_path):
    model = tiny_model("llama")
    assert resolve_dims("fix", model) == [16, 16, 16]
    assert resolve_dims("fix:5", model) == [5, 5, 5] == resolve_dims("5", model)   # C: generate and bench alike
    for bad, message in [("fix:0", "bad --dims"), ("0", "bad --dims"), ("nope", "bad --dims"),
                         ([1, 2], "gives 2 layers"), (str(tmp_path / "x.json"), "does not exist")]:
        with pytest.raises(UserError, match=message):
            resolve_dims(bad, model)
    from dofattn.dof import DofResult, LayerDof

    path = tmp_path / "dof.json"
    path.write_text(DofResult(model="other", layers=[LayerDof(i, 1.0, [1.0], 4, [4]) for i in range(3)]).to_json())
    with pytest.raises(UserError, match="computed for model 'other'"):
        resolve_dims(str(path), model, "mine")
    assert resolve_dims(str(path), model, "other") == [4, 4, 4]


def test_student_file_holds_only_trained_state(tmp_path, model_dirs):
    from dofattn.model.hf import load_model
    from dofattn.model.student import student_state

    model, _ = load_model(str(model_dirs["llama"]))
    linearize(model, [5, 7, 3], Attention(window=4, sink=1), seed=4)
    names = sorted(student_state(model))
    assert len(names) == 3 * 4 and {n.split(".dofattn.")[1] for n in names} == {
        "feature_map.directions", "feature_map.log_weights", "feature_map.key_shift", "window.log_gain"}


def test_older_student_folders_load_or_fail_clearly(tmp_path, model_dirs):
    """A schema-1 dofattn.json (decay and gate as flags, no schema field) loads as the same student, and so does
    one of 2026-12-02 (schema 4 with an empty `head_dims`); one with per-head dims, which a spec no longer holds,
    is refused with what to do."""
    import json

    from dofattn.model.hf import load_model

    model, _ = load_model(str(model_dirs["llama"]))
    linearize(model, [5, 12, 7], Attention(window=0, sink=0, decay="gate"), seed=2)
    spec = StudentSpec(str(model_dirs["llama"]), [5, 12, 7], [0, 1, 2], Attention(window=0, sink=0, decay="gate"),
                       seed=2, base=fingerprint(model))
    folder = save_student(model, tmp_path / "s", spec)
    flat = {k: v for k, v in json.loads(spec.to_json()).items() if k not in ("schema", "attention")}
    flat.update(spec.attention.__dict__)
    old = {**flat, "decay": True, "gate": True, "head_dims": None}       # how schema 1 wrote a gated student
    (folder / "dofattn.json").write_text(json.dumps(old))
    loaded, _, read = load_student(folder)
    assert read == spec and all(m.dofattn.attention.decay == "gate" for m in attention_modules(loaded))
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x, use_cache=False).logits, loaded(x, use_cache=False).logits)
    (folder / "dofattn.json").write_text(json.dumps({**json.loads(spec.to_json()), "head_dims": []}))
    assert read_spec(folder) == spec
    for written in (old, json.loads(spec.to_json())):
        (folder / "dofattn.json").write_text(json.dumps({**written, "head_dims": [[5] * 4, [12] * 4, [7] * 4]}))
        with pytest.raises(UserError, match="every head its own feature count.*distill the student again"):
            read_spec(folder)
    (folder / "dofattn.json").write_text(json.dumps({**json.loads(spec.to_json()), "schema": 5}))
    with pytest.raises(UserError, match="has schema 5.*upgrade dofattn"):
        read_spec(folder)
    (folder / "dofattn.json").write_text(json.dumps({**json.loads(spec.to_json()),
                                                     "attention": {"window": 0, "sink": 4}}))
    with pytest.raises(UserError, match="student.sink = 4 sits beside a softmax window"):
        read_spec(folder)
    (folder / "dofattn.json").write_text(json.dumps({**json.loads(spec.to_json()), "attention": {"windw": 3}}))
    with pytest.raises(UserError, match=r"unknown fields \['attention.windw'\]"):
        read_spec(folder)


def test_schema_2_folders_with_flat_tensor_names_load(tmp_path, model_dirs):
    """Before the attention parts, a layer's own tensors sat on it (`dofattn.log_gain`, `dofattn.decay_rate`, ...)
    and dofattn.json held the attention keys flat (schema 2). Such a folder loads as the same student."""
    import json

    from safetensors.torch import load_file, save_file

    from dofattn.model.hf import load_model
    from dofattn.spec import WEIGHTS_FILE

    model, _ = load_model(str(model_dirs["llama"]))
    attention = Attention(window=4, sink=0, decay="head", conv=2)
    linearize(model, [5, 12, 7], attention, seed=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".dofattn." in name and "feature_map" not in name:
                p.add_(0.1 * torch.randn_like(p))
    spec = StudentSpec(str(model_dirs["llama"]), [5, 12, 7], [0, 1, 2], attention, seed=2, base=fingerprint(model))
    folder = save_student(model, tmp_path / "s", spec)
    state = load_file(folder / WEIGHTS_FILE)
    flat_names = {n.replace(".dofattn.window.", ".dofattn.").replace(".dofattn.decay.", ".dofattn.")
                  .replace(".dofattn.conv.", ".dofattn."): t for n, t in state.items()}
    assert len(flat_names) == len(state) and any(n.endswith(".dofattn.log_gain") for n in flat_names)
    save_file(flat_names, str(folder / WEIGHTS_FILE))
    old = {k: v for k, v in json.loads(spec.to_json()).items() if k != "attention"}
    (folder / "dofattn.json").write_text(json.dumps({**old, **spec.attention.__dict__, "schema": 2}))
    loaded, _, read = load_student(folder)
    assert read == spec
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x, use_cache=False).logits, loaded(x, use_cache=False).logits)


def test_the_package_hands_out_its_public_names_lazily():
    """`from dofattn import load, linearize, Attention, ...` works, and importing dofattn alone loads no torch (the
    CLI's --help stays quick)."""
    import subprocess
    import sys

    import dofattn
    from dofattn import Attention, Kept, StaticDecoder, linearize, load, load_recipe  # noqa: F401

    assert load_recipe().name == "long-context" and Attention().window == 64
    assert set(dofattn.__all__) >= {"load", "linearize", "Attention", "Kept", "StaticDecoder"}
    with pytest.raises(AttributeError, match="no attribute 'nothere'"):
        dofattn.nothere
    code = "import sys, dofattn; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize("path,message", [("/no/such/student", "/no/such/student does not exist: give a run folder"),
                                          (123, "load takes the path of a student"),
                                          (None, "load takes the path of a student")])
def test_load_names_what_is_wrong_with_its_path(path, message):
    import dofattn

    with pytest.raises(UserError, match=message):
        dofattn.load(path)


@pytest.mark.parametrize("args, kwargs, message", [
    ((64,), {}, "dims must be a list of feature dimensions, one per layer \\(3\\), got int"),
    (("64",), {}, "dims must be a list"),
    (([8] * 5,), {}, "dims has 5 entries for a model with 3 layers"),
    (([8, 0, 8],), {}, "dims\\[1\\] must be a whole number of features of at least 1, got 0"),
    (([8, 8.5, 8],), {}, "dims\\[1\\] must be a whole number"),
    (([8, float("nan"), 8],), {}, "dims\\[1\\] must be a whole number"),
    (([8] * 3, "window"), {}, "takes a dofattn.spec.Attention as its attention, got str"),
    (([8] * 3,), {"layers": [0, 7]}, "out of range for a model with 3 layers"),
    (([8] * 3,), {"layers": [1, 1]}, "distinct whole layer indices"),
    (([8] * 3,), {"layers": 2}, "layers must be a list of layer indices"),
    (([8] * 3,), {"seed": 1.5}, "seed must be a whole number"),
    (([8] * 3,), {"kept": 4}, "takes a dofattn.spec.Kept"),
])
def test_linearize_checks_its_arguments_before_it_changes_the_model(args, kwargs, message):
    """A bad argument is one UserError and the model is left whole: no layer converted, its logits unchanged."""
    model = tiny_model("llama")
    ids = torch.arange(10)[None]
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(UserError, match=message):
        linearize(model, *args, **kwargs)
    assert not any(linear_of(m) or bounded_of(m) for m in attention_modules(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_linearize_refuses_a_student_and_a_non_model():
    model = linearize(tiny_model("llama"), [8] * 3)
    with pytest.raises(UserError, match="the model is a student already"):
        linearize(model, [8] * 3)
    with pytest.raises(UserError, match="takes a loaded Hugging Face model"):
        linearize("smollm2-135m", [8] * 3)
