"""Device prices ("flashflex.prices/1"): what one device-hour of each device type costs, validated on load.

A prices file lists rows `{"type": ..., "per_device_hour": ...}` (one currency for the whole file) with
where each figure comes from. A row's type is a catalog name or alias (matched as the catalog's own
name) or any other type string a cluster file uses (matched exactly). `default_per_device_hour`, when
given, prices every type without a row; otherwise a cluster device whose type has no row is refused.

Charging (docs/prices.md): a plan's cost per hour is the sum of the prices of the devices it *uses*;
the cost of the whole cluster (idle devices too: rented machines are paid for whether busy or not) is
shown beside it. $ per million tokens = dollars per hour / (tokens/s x 3600) x 1e6.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ...errors import InputError
from ...fileio import load_model
from ...hardware.catalog import canonical_name
from ...hardware.cluster import Cluster
from ...physical_limits import PER_DEVICE_HOUR, limited

PRICES_SCHEMA = "flashflex.prices/1"
PerDeviceHour = limited(PER_DEVICE_HOUR)  # physical_limits.py: 1e-6 to 1e6 per device-hour, and why


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)


class PriceRow(_Strict):
    """One device type's price per device-hour, and where the figure comes from."""

    type: str = Field(min_length=1)
    per_device_hour: PerDeviceHour
    provider: str = ""
    offer: str = ""
    source: str = ""
    date: str = ""


class PriceList(_Strict):
    """A prices file: one currency, rows by device type, and an optional price for every other type."""

    schema_: Literal["flashflex.prices/1"] = Field(PRICES_SCHEMA, alias="schema")
    currency: str = Field("USD", min_length=1, max_length=8)
    date: str = ""
    description: str = ""
    prices: list[PriceRow] = Field(min_length=1)
    default_per_device_hour: PerDeviceHour | None = None


def _type_key(name: str) -> str:
    """A catalog type's own name (aliases resolved), any other type string as written."""
    try:
        return canonical_name(name)
    except InputError:
        return name.strip()


def load_prices(path: str | os.PathLike[str]) -> tuple[PriceList, str]:
    """Load and validate a prices file; returns it and the sha256 of its bytes (recorded in plans).
    Two rows for one type (after resolving aliases) are refused."""
    prices: PriceList = load_model(path, PriceList, PRICES_SCHEMA)
    seen: dict[str, int] = {}
    for i, row in enumerate(prices.prices):
        key = _type_key(row.type)
        if key in seen:
            raise InputError(f"{path}: prices.{i}.type: {row.type!r} is priced twice (also prices.{seen[key]})")
        seen[key] = i
    with open(path, "rb") as handle:
        sha = hashlib.sha256(handle.read()).hexdigest()
    return prices, sha


@dataclass(frozen=True)
class DevicePrices:
    """Price per hour of every device of one cluster (currency units per hour, by device id)."""

    per_device: dict[str, float]
    currency: str
    sha256: str = ""

    def hourly(self, devices: Iterable[str]) -> float:
        """Currency units per hour of `devices` (ids of this cluster)."""
        return float(sum(self.per_device[d] for d in devices))

    def cluster_hourly(self) -> float:
        """Currency units per hour of every device of the cluster."""
        return float(sum(self.per_device.values()))


def prices_for(prices: PriceList, cluster: Cluster, source: str = "prices file", sha256: str = "") -> DevicePrices:
    """Each device's price per hour; InputError naming the type and a node when a type has no price."""
    table = {_type_key(row.type): row.per_device_hour for row in prices.prices}
    out: dict[str, float] = {}
    for node in cluster.nodes:
        for index, device in enumerate(node.devices):
            price = table.get(_type_key(device.type), prices.default_per_device_hour)
            if price is None:
                raise InputError(f"{source}: no price for device type {device.type!r} (node {node.name}); add a "
                                 f"row for it or a default_per_device_hour")
            out[f"{node.name}/{index}"] = float(price)
    return DevicePrices(out, prices.currency, sha256)


def per_million_tokens(per_hour: float, tokens_per_s: float) -> float:
    """Currency units per million tokens at `per_hour` (units/hour) and `tokens_per_s`; inf at 0 tokens/s."""
    if not tokens_per_s > 0 or not math.isfinite(tokens_per_s):
        return math.inf
    return per_hour / (tokens_per_s * 3600.0) * 1e6
