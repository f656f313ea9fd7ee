"""The recipes `dofattn distill --recipe` takes, one recipe resolved, or every recipe key explained.

    dofattn recipes                       # the packaged recipes, one line each
    dofattn recipes long                  # every key of one recipe, resolved, as TOML (a file --recipe takes)
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


def recipe_lines() -> str:
    """The packaged recipes, one line each."""
    from dofattn import recipe as recipes

    return "\n".join(f"  {name:<14}{line}" for name, line in recipes.packaged().items())
