"""Evaluate the PromQL a dashboard sends, over two scrapes of /metrics, as Prometheus would with a
range window holding exactly those two samples of each series.

PyPI has PromQL parsers (promql-parser, used here: the Rust crate Prometheus-compatible tools
use) but no evaluator, and a Prometheus server cannot be fetched where CI runs. So this walks the
parsed query itself, for what dashboards use: selectors with label matchers, `rate` / `increase`
over a range, `histogram_quantile` (Prometheus's bucket interpolation), aggregations `by` /
`without`, arithmetic between vectors (one-to-one on their labels) and scalars.

`rate` and `increase` take the two samples exactly, without Prometheus's extrapolation to the
window's edges: that scales every series sampled at the same instants by the same factor, so the
ratios and quantiles a panel shows are unchanged, and counts stay exact. A series absent from the
first scrape counts from 0 (Baton's counters appear at their first event).
"""
from __future__ import annotations

import math
import re
from collections import defaultdict

import promql_parser as pp

Labels = tuple[tuple[str, str], ...]          # sorted (name, value) pairs; "__name__" on raw selections
Vector = dict[Labels, float]


class Scrapes:
    def __init__(self, before: list, after: list, seconds: float):
        self.before, self.after, self.seconds = before, after, seconds

    def evaluate(self, expr: str) -> float | Vector:
        return self._eval(pp.parse(expr))

    # -- the walk ---------------------------------------------------------------------------
    def _eval(self, node):
        if isinstance(node, pp.NumberLiteral):
            return float(node.val)
        if isinstance(node, pp.ParenExpr):
            return self._eval(node.expr)
        if isinstance(node, pp.VectorSelector):
            return self._select(node, self.after)
        if isinstance(node, pp.Call):
            return self._call(node.func.name, list(node.args))
        if isinstance(node, pp.AggregateExpr):
            return self._aggregate(str(node.op), self._eval(node.expr), node.modifier)
        if isinstance(node, pp.BinaryExpr):
            m = node.modifier
            if m is not None and (m.matching is not None or m.card != pp.VectorMatchCardinality.OneToOne):
                raise NotImplementedError(f"vector matching modifiers: {node.prettify()}")
            return _binary(str(node.op), self._eval(node.lhs), self._eval(node.rhs))
        raise NotImplementedError(f"{type(node).__name__}: {node.prettify()}")

    def _select(self, vs, samples) -> Vector:
        return {_key({**s.labels, "__name__": s.name}): s.value for s in samples if _matches(vs, s)}

    def _call(self, name: str, args: list):
        if name in ("rate", "increase"):
            (matrix,) = args
            if not isinstance(matrix, pp.MatrixSelector):
                raise NotImplementedError(f"{name} of a subquery")
            first = self._select(matrix.vector_selector, self.before)
            last = self._select(matrix.vector_selector, self.after)
            scale = 1.0 / self.seconds if name == "rate" else 1.0
            return {_drop_name(k): (v - first.get(k, 0.0)) * scale for k, v in last.items()}
        if name == "histogram_quantile":
            q, vector = self._eval(args[0]), self._eval(args[1])
            return histogram_quantile(q, vector)
        raise NotImplementedError(f"function {name}")

    @staticmethod
    def _aggregate(op: str, vector: Vector, modifier) -> Vector:
        groups: dict[Labels, list[float]] = defaultdict(list)
        for labels, value in vector.items():
            named = dict(labels)
            named.pop("__name__", None)
            if modifier is None:
                kept = {}
            elif modifier.type == pp.AggModifierType.By:
                kept = {k: v for k, v in named.items() if k in modifier.labels}
            else:
                kept = {k: v for k, v in named.items() if k not in modifier.labels}
            groups[_key(kept)].append(value)
        ops = {"sum": sum, "max": max, "min": min, "count": len, "avg": lambda xs: sum(xs) / len(xs)}
        if op not in ops:
            raise NotImplementedError(f"aggregation {op}")
        return {k: float(ops[op](vs)) for k, vs in groups.items()}


def histogram_quantile(q: float, vector: Vector) -> Vector:
    """Prometheus's: per series (its labels but `le`), the q-quantile by linear interpolation inside
    the bucket it falls in; the lowest bucket starts at 0; past the highest finite bound, that bound;
    NaN for a histogram with no observations."""
    series: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for labels, value in vector.items():
        named = dict(labels)
        named.pop("__name__", None)
        le = float(named.pop("le"))
        series[_key(named)].append((le, value))
    out = {}
    for labels, buckets in series.items():
        buckets.sort()
        total = buckets[-1][1]
        if not math.isinf(buckets[-1][0]) or total <= 0:
            out[labels] = math.nan
            continue
        rank = q * total
        lower, below = 0.0, 0.0
        for upper, count in buckets:
            if count >= rank:
                if math.isinf(upper):
                    out[labels] = buckets[-2][0] if len(buckets) > 1 else math.nan
                elif count == below:
                    out[labels] = upper
                else:
                    out[labels] = lower + (upper - lower) * (rank - below) / (count - below)
                break
            lower, below = upper, count
    return out


def _binary(op: str, lhs, rhs):
    fn = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": _divide}[op]
    if isinstance(lhs, float) and isinstance(rhs, float):
        return fn(lhs, rhs)
    if isinstance(rhs, float):
        return {_drop_name(k): fn(v, rhs) for k, v in lhs.items()}
    if isinstance(lhs, float):
        return {_drop_name(k): fn(lhs, v) for k, v in rhs.items()}
    right = {_drop_name(k): v for k, v in rhs.items()}
    return {k: fn(v, right[k]) for k, v in ((_drop_name(k), v) for k, v in lhs.items()) if k in right}


def _divide(a: float, b: float) -> float:
    if b == 0:
        return math.nan if a == 0 else math.copysign(math.inf, a)
    return a / b


def _matches(vs, sample) -> bool:
    if vs.name and sample.name != vs.name:
        return False
    for m in vs.matchers.matchers:
        value = sample.name if m.name == "__name__" else sample.labels.get(m.name, "")
        if m.op == pp.MatchOp.Equal:
            ok = value == m.value
        elif m.op == pp.MatchOp.NotEqual:
            ok = value != m.value
        else:
            ok = (re.fullmatch(m.value, value) is not None) == (m.op == pp.MatchOp.Re)
        if not ok:
            return False
    return True


def _key(labels: dict) -> Labels:
    return tuple(sorted(labels.items()))


def _drop_name(labels: Labels) -> Labels:
    return tuple(kv for kv in labels if kv[0] != "__name__")
