"""Parameters picked by name, for fine-tuning: what to freeze, which groups learn at which rate, which start over.

A selector is a prefix of parameter names (``processor.``, ``networks.advection1d.lift``) or the name of a group
the model defines in its ``parameter_groups`` (the multi-physics model's ``trunk``, ``field_rows``, ``patches``,
``decoders``). Every selector must select a parameter: a typo is a config error naming the model's groups and
names, not a setting that silently does nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from train.errors import ConfigError


def prefixes(model: nn.Module, selector: str) -> tuple[str, ...]:
    """The name prefixes ``selector`` stands for in ``model``."""
    groups = getattr(model, "parameter_groups", None) or {}
    return tuple(groups[selector]) if selector in groups else (selector,)


def selected(model: nn.Module, selector: str, setting: str) -> list[str]:
    """The names of the parameters ``selector`` selects; ConfigError naming ``setting`` when none."""
    names = [name for name, _ in model.named_parameters()]
    chosen = [name for name in names if name.startswith(prefixes(model, selector))]
    if not chosen:
        groups = sorted(getattr(model, "parameter_groups", None) or {})
        tops = sorted({name.split(".")[0] for name in names})
        known = f"the model's groups: {', '.join(groups)}; " if groups else ""
        raise ConfigError(
            f"{setting}: {selector!r} matches no parameter of the model ({known}its parameters start with "
            f"{', '.join(tops)}; e.g. {names[0]})"
        )
    return chosen


def lr_multipliers(model: nn.Module, groups: dict[str, float]) -> dict[str, float]:
    """Each parameter's learning-rate multiplier under train.lr_groups (the first selector that matches it; 1.0
    where none does)."""
    chosen = {selector: set(selected(model, selector, "train.lr_groups")) for selector in groups}
    out = {}
    for name, _ in model.named_parameters():
        out[name] = next((groups[s] for s, names in chosen.items() if name in names), 1.0)
    return out


def optimizer_groups(model: nn.Module, groups: dict[str, float], lr: float) -> list[dict]:
    """The trainable parameters in optimizer groups by learning rate (``lr`` times the multiplier), in the order
    of their first parameter: the same groups, in the same order, whenever the model and settings are the same."""
    multipliers = lr_multipliers(model, groups)
    by_rate: dict[float, list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            by_rate.setdefault(multipliers[name], []).append(p)
    return [{"params": params, "lr": lr * rate} for rate, params in by_rate.items()]


def names_of(model: nn.Module, selectors: Iterable[str], setting: str) -> set[str]:
    """Every parameter name the selectors select (each must select one)."""
    return {name for selector in selectors for name in selected(model, selector, setting)}
