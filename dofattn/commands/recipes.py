"""The recipes `dofattn distill --recipe` takes, one recipe resolved, or every recipe key explained.

    dofattn recipes                       # the packaged recipes, one line each
    dofattn recipes window                # every key of one recipe, resolved, as TOML (a file --recipe takes)
    dofattn recipes --keys                # every key: type, default, meaning
"""

from __future__ import annotations

from dataclasses import dataclass

from dofattn.commands import add_verb, config
from dofattn.options import option


@dataclass
class RecipesArgs:
    """What to print: one recipe, every key, or (neither) the list."""

    name: str | None = option(None, "a recipe name or .toml file to print resolved", positional=True)
    keys: bool = option(False, "every recipe key with its type, default and meaning")


def options() -> list[type]:
    return [RecipesArgs]


def add_parser(verbs):
    return add_verb(verbs, "recipes", __doc__, options())


def run(ns) -> int:
    """The `recipes` verb."""
    from dofattn import recipe as recipes

    args = config(RecipesArgs, ns)
    if args.keys:
        print(recipes.describe_keys())
    elif args.name:
        print(recipes.load(args.name).to_toml(), end="")
    else:
        print(recipe_lines())
    return 0


def recipe_lines(brief: bool = False) -> str:
    """The packaged recipes, the default first: what each trains, and (unless `brief`) what it reaches on
    SmolLM2-135M and what it costs."""
    from dofattn import recipe as recipes

    lines = []
    for name, info in recipes.packaged_info().items():
        label = f"{name} (default)" if name == recipes.DEFAULT else name
        lines.append(f"  {label:<24}{info['description']}")
        if not brief and (info["reaches"] or info["costs"]):
            lines.append(f"  {'':<24}reaches {info['reaches']}; {info['costs']}")
    return "\n".join(lines)
