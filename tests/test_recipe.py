"""Recipe files: every packaged recipe loads and round-trips through its resolved TOML, --set values take their
key's type, and every bad key or value is a one-line error naming the key and what it takes."""


import pytest

from dofattn import recipe as recipes
from dofattn.errors import UserError


@pytest.mark.parametrize("name", list(recipes.packaged()))
def test_a_resolved_recipe_loads_back_to_itself(tmp_path, name):
    recipe = recipes.load(name)
    path = tmp_path / "recipe.toml"
    path.write_text(recipe.to_toml())
    assert recipes.load(str(path)) == recipe
    assert recipe.name == name and recipe.description == recipes.packaged()[name]


def test_the_window_recipe_file_gives_the_defaults():
    """window.toml gives each key it names at the value a recipe that leaves it out gets (a new key need not be
    written there: its default is the code's), and the window recipe is the recipe of defaults."""
    text, _ = recipes.read_text("window")
    given = recipes.tomllib.loads(text)
    fields = recipes.key_fields()
    for table, content in given.items():
        for name, value in (content.items() if isinstance(content, dict) else ()):
            assert fields[f"{table}.{name}"][1] == value, f"{table}.{name}"
    assert recipes.load("window") == recipes.Recipe(name="window", description=recipes.packaged()["window"])


def test_the_default_recipe_is_the_best_measured_student():
    """`dofattn distill` without --recipe trains long-context; `dofattn recipes` lists it first, and every packaged
    recipe with what it reaches and costs."""
    assert recipes.load().name == recipes.DEFAULT == "long-context" == next(iter(recipes.packaged()))
    info = recipes.packaged_info()
    assert all(entry["description"] and entry["reaches"] and entry["costs"] for entry in info.values())


@pytest.mark.parametrize("item,key,value", [
    ("student.window=32", "student.window", 32),
    ("window=32", "student.window", 32),                     # a bare key that one table has
    ("end_to_end.lr=1e-3", "end_to_end.lr", 1e-3),
    ("end_to_end.lr=1", "end_to_end.lr", 1.0),               # an integer where a number is asked for
    ("end_to_end.activation_checkpointing=true", "end_to_end.activation_checkpointing", True),
    ("student.dims=fix:8", "student.dims", "fix:8"),         # not TOML: the bare text
    ('student.dims="fix"', "student.dims", "fix"),
    ("student.decay=none", "student.decay", "none"),         # a value, where the key cannot be unset
    ("end_to_end.conv_lr=none", "end_to_end.conv_lr", None),  # unset, where it may be
    ("run.eval_data=notes.txt", "run.eval_data", "notes.txt"),
])
def test_set_values_take_their_keys_type(item, key, value):
    sets = [item, "student.conv=2"] if "conv_lr" in item else [item]
    got = recipes.load("paper", sets).keys()[key]
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("sets,message", [
    (["student.windw=3"], "unknown recipe key 'student.windw'; did you mean student.window?"),
    (["lr=0.1"], "recipe key 'lr' is in several tables: say which, layerwise.lr or end_to_end.lr"),
    (["window"], "--set 'window': give KEY=VALUE"),
    (["window=3.5"], "student.window = 3.5 is not an integer"),
    (["activation_checkpointing=1"], "end_to_end.activation_checkpointing = 1 is not true or false"),
    (["steps=true"], "in several tables"),
    (["layerwise.steps=true"], "layerwise.steps = True is not an integer"),
    (["run.seed=none"], "run.seed = 'none' is not an integer"),
    (["run.dtype=float16"], "run.dtype = 'float16'; use one of float32, bfloat16"),
    (["layerwise.loss=output"], "layerwise.loss = 'output'; use one of softmax, l2"),
    (["eval.blocks=0"], "eval.blocks = 0: give >= 1"),
    (["end_to_end.loss_chunk=-1"], "end_to_end.loss_chunk = -1: give >= 0"),
    (["end_to_end.activation_checkpointing=2"], "end_to_end.activation_checkpointing = 2 is not true or false"),
])
def test_bad_sets_are_one_line_errors(sets, message):
    with pytest.raises(UserError) as error:
        recipes.load("window", sets)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_old_recipe_name_says_its_new_one():
    with pytest.raises(UserError, match="recipe 'default' is now 'window' .*dofattn distill trains long-context"):
        recipes.load("default")


def test_bad_files_are_one_line_errors(tmp_path):
    cases = {"format = 2\n": "has format 2; this dofattn reads format 1",
             "[training]\nsteps = 3\n": "unknown table [training]; the tables are run, student, dof",
             "[student]\nwindw = 3\n": "unknown recipe key 'student.windw'",
             "[student]\nwindow = '64'\n": "student.window = '64' is not an integer",
             "[student\n": "is not valid TOML"}
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"r{i}.toml"
        path.write_text(text)
        with pytest.raises(UserError) as error:
            recipes.load(str(path))
        assert message in str(error.value), (text, error.value)
    with pytest.raises(UserError, match="unknown recipe 'nonesuch'; use one of long-context, "):
        recipes.load("nonesuch")
    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes(range(256)) * 2)
    with pytest.raises(UserError, match="binary.bin is not text"):
        recipes.load(str(binary))


def test_every_key_has_a_meaning_and_a_type_the_files_can_hold():
    for key, (kind, _, meaning, choices) in recipes.key_fields().items():   # _: the default
        assert meaning and recipes.type_name(kind).rstrip("?") in ("int", "float", "str", "bool"), key
        if choices:
            assert _ in choices, key


@pytest.mark.parametrize("fast,expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_is_what_the_device_computes_fast_and_is_recorded(monkeypatch, fast, expected):
    """run.dtype = auto resolves before a run (the run folder's recipe.toml holds the resolved one), by the device."""
    from dofattn.model import hf
    from dofattn.recipe import resolve_dtype

    monkeypatch.setattr(hf, "fast_bfloat16", lambda device: fast)
    recipe = recipes.load("window", ["run.dtype=auto"])
    resolved = resolve_dtype(recipe, "cpu")
    assert resolved.run.dtype == expected and 'dtype = "' + expected + '"' in resolved.to_toml()
    assert resolve_dtype(recipes.load("window"), "cpu").run.dtype == "float32"      # an explicit dtype stays


def test_keys_that_left_are_read_at_their_defaults_and_refused_otherwise(tmp_path):
    """A run folder's recipe.toml from before the delta rule and state passing left names them at their defaults:
    it still loads; set to anything else, one line says they left."""
    text = recipes.load("window").to_toml()
    old = tmp_path / "old.toml"
    old.write_text(text.replace("[student]\n", "[student]\ndelta = false\n").replace("[end_to_end]\n",
                                                                                       "[end_to_end]\ncarry = 0\n"))
    assert recipes.load(str(old)) == recipes.load("window")
    assert recipes.load("window", ["student.delta=false", "carry=0"]) == recipes.load("window")
    old.write_text(text.replace("[end_to_end]\n", "[end_to_end]\ncarry = 256\n"))
    with pytest.raises(UserError, match="end_to_end.carry = 256 measured worse or flat.*remove the key"):
        recipes.load(str(old))
