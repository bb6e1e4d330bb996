"""Where a memory plan puts the weights: a model's layers split over devices (a count, a list of
names, or a `device_map`), each device name checked before anything is planned."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from heads._util.validation import check_int, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError

__all__: list[str] = []  # internal: used by heads.planning.plan


def _device_split(
    names: Sequence[str], kinds: list[str], devices: object
) -> list[tuple[str, set[int], list[str]]]:
    """`(device, its layer indices, parameter-name prefixes it holds)` per device."""
    n = len(kinds)
    if devices is None:
        return [("cpu", set(range(n)), [""])]
    if isinstance(devices, bool) or not isinstance(devices, (int, str, Sequence, Mapping)):
        raise HeadsteerTypeError(
            "devices must be None, a device count, a list of devices or a device_map, got "
            f"{short_repr(devices)}"
        )
    if isinstance(devices, str):
        return [(_check_device(devices), set(range(n)), [""])]
    if isinstance(devices, int):
        devices = [f"cuda:{i}" for i in range(check_int("devices", devices, lo=1, hi=max(n, 1)))]
    if isinstance(devices, Mapping):  # a device_map {module prefix: device}
        for dev in devices.values():
            if isinstance(dev, bool) or not isinstance(dev, (str, int)):
                raise HeadsteerValueError(
                    f"device_map values must be device names or GPU indices, got {short_repr(dev)}"
                )
            _check_device(f"cuda:{dev}" if isinstance(dev, int) else dev)
        return _from_map(names, n, devices)
    for x in devices:
        if isinstance(x, bool) or not isinstance(x, (str, int)):
            raise HeadsteerValueError(f"devices must be device names or GPU indices, got {short_repr(x)}")
    devs = [_check_device(f"cuda:{x}" if isinstance(x, int) else x) for x in devices]
    if not devs:
        raise HeadsteerValueError("devices is empty")
    if len(devs) > n:
        raise HeadsteerValueError(
            f"{len(devs)} devices for a model of {n} layers: at most one device per layer"
        )
    dup = next((d for i, d in enumerate(devs) if d in devs[:i]), None)
    if dup is not None:
        raise HeadsteerValueError(f"device {dup!r} is listed twice")
    # layers split evenly in order (accelerate's sequential placement); the embedding with the
    # first layers, the final norm and the unembedding with the last
    per = -(-n // len(devs))
    out: list[tuple[str, set[int], list[str]]] = []
    for i, dev in enumerate(devs):
        layers = set(range(i * per, min(n, (i + 1) * per)))
        out.append((dev, layers, []))
    return out


def _is_index(text: str) -> bool:
    """ASCII digits, at most 6 (a layer index; `int()` of other digits fails or is unbounded)."""
    return text.isascii() and text.isdigit() and len(text) <= 6


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("layers", "h", "layer", "blocks") and _is_index(parts[i + 1]):
            return int(parts[i + 1])
    return None


def _from_map(names: Sequence[str], n: int, device_map: Mapping) -> list[tuple[str, set[int], list[str]]]:
    devs: dict[str, tuple[set[int], list[str]]] = {}
    for prefix, dev in device_map.items():
        if not isinstance(prefix, str):
            raise HeadsteerValueError(f"device_map keys must be module names, got {short_repr(prefix)}")
        entry = devs.setdefault(str(dev), (set(), []))
        entry[1].append(prefix)
        layer = _layer_of(prefix + ".x")
        if layer is not None:
            entry[0].add(layer)
    unplaced = [x for x in names if not any(_owns(p, x) for _, ps in devs.values() for p in ps)]
    if unplaced:
        raise HeadsteerValueError(f"device_map places no device for {short_repr(unplaced[0])}")
    return [(d, layers, prefixes) for d, (layers, prefixes) in devs.items()]


def _owns(prefix: str, name: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


# ---------------------------------------------------------------- the plan
def _check_device(name: str) -> str:
    """A device name torch parses, not disk (offloaded weights are not planned)."""
    if name == "disk":
        raise HeadsteerValueError("device 'disk' is not planned: offloaded weights are outside the plan")
    try:
        torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise HeadsteerValueError(f"device {short_repr(name)} is not a torch device") from None
    return name
