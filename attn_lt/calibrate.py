"""Where ``auto`` gets its measurements: the calibration of this GPU (``attn-lt calibrate``) and the calibrations
shipped with the package.

``attn-lt calibrate`` times the fused path against the long path over a grid of query length × key length × head
dim × causal (:func:`grid`; bf16) and keeps the raw points and a compact rule derived from them
(:func:`derive_rules`): for each (head dim, causal, query-length bucket) the smallest measured key length from which
``lt`` is faster at every longer measured key length, or never. Masks need no rule (only ``lt`` runs them), nor
calls that ask for the attention mass per key.

Files (schema ``attn_lt.calibration``, ``version`` 2):

* ``calibration.json`` in the cache directory: ``{"schema", "version": 2, "thresholds": {env key: entry}}``, one
  entry per environment (GPU name, compute capability, SM count, cuBLASLt version: the algorithm cache's key).
  An entry is either measured, ``{"gpu", "cc", "date", "rules": [...], "points": [...], ...}``, or one threshold
  for every case, ``{"threshold": N, "points": [...]}`` — the form every entry of a version-1 file has, so a v1
  file is read as it is (its single threshold applies to every bucket), and an older attn_lt reading a v2 file
  finds no ``threshold`` in a measured entry and falls back to its default.
* ``attn_lt/calibrations/*.json`` (package data, :data:`SHIPPED_DIR`): the same document keyed by GPU name and
  compute capability only (``"NVIDIA H100 80GB HBM3|sm9.0"``), written by ``attn-lt calibrate --ship DIR``. It
  applies on any machine with that GPU model, whatever its driver, cuBLASLt version or SM count (a cut-down
  part with another name is another model).

Nothing about these files is fatal: an unreadable, malformed or foreign file or entry is reported once (logger
``attn_lt``) and ignored. The selector (``attn_lt.select``) asks :func:`calibrations` once per new plan; the files
are read once per (cache directory, shipped directory, GPU).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import config
from .device import current_index
from .validate import Case, MaskInfo

log = logging.getLogger("attn_lt")

SCHEMA = "attn_lt.calibration"
VERSION = 2
NEVER = 2**31 - 1  # a single threshold that the long path never reaches
FILE = "calibration.json"
MAX_FILE_BYTES = 1 << 20

#: Directory of the shipped calibrations (package data); tests point it elsewhere.
SHIPPED_DIR = Path(__file__).resolve().parent / "calibrations"

#: The query-length bucket of prefill (Sq = Sk) in rules.
PREFILL = "Sk"

#: The default grid of ``attn-lt calibrate`` (a head dim, or a case, only where the fused path runs it).
QUERY_LENGTHS = (1, 16, 128, 1024)
KEY_LENGTHS = (1024, 4096, 16384, 65536)
HEAD_DIMS = (64, 128, 192, 256, 576)
#: v's head dim where a measured head dim is not its own: 192 is measured as MLA prefill (q/k 192, v 128) and 576
#: as MLA decode (q/k 576, v k's first 512 columns: :data:`LATENT_DIMS`), the only such cases the fused path runs,
#: so their rules decide every case of those head dims either path could run.
VALUE_DIMS = {192: 128, 576: 512}
#: Head dims measured with v a view of k's first columns (an MLA latent cache), and B8 Hq128 Hkv1 at decode.
LATENT_DIMS = (576,)


def value_dim(D: int) -> int:
    """v's head dim in the measured cases of head dim ``D``."""
    return VALUE_DIMS.get(D, D)
#: Causal cases are measured from this query length on; shorter causal cases use the non-causal rule (a causal
#: query row sees all but its last Sq - 1 keys: at Sq < 16 the mask changes almost nothing).
CAUSAL_MIN_SQ = 16
#: Bound on the K and V bytes of one measured case (the batch shrinks to stay below it).
KV_BYTES_MAX = 8 << 30
#: Masked cases (a dense (B, 1, Sq, Sk) additive mask in the input dtype; non-causal) are measured where the mask
#: takes at most this many bytes: 8 GiB takes the 64k prefill (at 1 GiB the longest masked prefill measured was 16k,
#: and the rule extrapolated the long path's win there to 32k-128k, where on the H200 the fused kernel is 1.25x
#: faster).
MASK_BYTES_MAX = 8 << 30


# ---- the grid ----------------------------------------------------------------------------------------------------

def shape(D: int, Sq: int, Sk: int) -> tuple[int, int, int]:
    """(B, Hq, Hkv) of a measured case: enough work to fill the GPU, as the case runs in practice. Decode
    (Sq <= 16): B=4, Hq=32, Hkv=8 (GQA 4). Prefill (Sq = Sk): B·Hq·Sq = 2^18 (the FlashAttention-3 protocol's
    B·S = 16k at 16 heads), 16 heads at most. Otherwise 16 heads and B·Hq for at least 256 CTAs of 128 query rows,
    between 64 and 256. A latent head dim (:data:`LATENT_DIMS`) at decode: B=8, Hq=128, Hkv=1. The batch halves
    while K and V would exceed :data:`KV_BYTES_MAX`."""
    if Sq <= 16 and D in LATENT_DIMS:
        B, Hq, Hkv = 8, 128, 1
    elif Sq <= 16:
        B, Hq, Hkv = 4, 32, 8
    elif Sq == Sk:
        bh = max(1, (1 << 18) // Sq)
        Hq = min(16, bh)
        B, Hkv = max(1, bh // Hq), Hq
    else:
        tiles = -(-Sq // 128)
        bh = min(256, max(64, -(-256 // tiles)))
        Hq = 16
        B, Hkv = -(-bh // Hq), Hq
    while B > 1 and B * Hkv * Sk * D * 2 * 2 > KV_BYTES_MAX:
        B //= 2
    return B, Hq, Hkv


def grid(dims=HEAD_DIMS, key_lengths=KEY_LENGTHS, query_lengths=QUERY_LENGTHS, prefill: bool = True,
         masks: bool = True) -> list[dict]:
    """The cases ``attn-lt calibrate`` measures, as dicts with D, Dv, causal, mask, Sq, Sk, B, Hq, Hkv: every head
    dim × key length × query length (Sq <= Sk) and, with ``prefill``, Sq = Sk; causal as well where Sq >= 16; with
    ``masks``, the non-causal cases again with a dense mask of at most :data:`MASK_BYTES_MAX`. Ordered
    by head dim, key length, query length; no case twice. (``attn-lt calibrate`` leaves out the cases the fused
    path cannot run: :func:`job_case` describes one.)"""
    out, seen = [], set()
    for D in sorted(set(dims)):
        for Sk in sorted(set(key_lengths)):
            sqs = sorted({s for s in query_lengths if s <= Sk} | ({Sk} if prefill else set()))
            for Sq in sqs:
                B, Hq, Hkv = shape(D, Sq, Sk)
                variants = [(c, False) for c in ((False, True) if Sq >= CAUSAL_MIN_SQ else (False,))]
                variants += [(False, True)] if masks and B * Sq * Sk * 2 <= MASK_BYTES_MAX else []
                for causal, mask in variants:
                    if (D, causal, mask, Sq, Sk) not in seen:
                        seen.add((D, causal, mask, Sq, Sk))
                        out.append({"D": D, "Dv": value_dim(D), "v_in_k": D in LATENT_DIMS, "causal": causal,
                                    "mask": mask, "Sq": Sq, "Sk": Sk, "B": B, "Hq": Hq, "Hkv": Hkv})
    return out


def job_case(job: dict) -> Case:
    """The :class:`~attn_lt.validate.Case` of one :func:`grid` case (bf16, contiguous; a mask (B, 1, Sq, Sk))."""
    B, Sq, Sk = job["B"], job["Sq"], job["Sk"]
    mask = MaskInfo("float", "bf16", (B, 1, Sq, Sk), (Sq * Sk, 0, Sk, 1)) if job.get("mask") else None
    return Case.contiguous(B, job["Hq"], job["Hkv"], Sq, Sk, job["D"], causal=job["causal"], mask=mask,
                           Dv=job.get("Dv", job["D"]), v_in_k=job.get("v_in_k", False))


# ---- rules ---------------------------------------------------------------------------------------------------

def _pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _ms(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _valid_point(p) -> bool:
    return (isinstance(p, dict) and all(_pos_int(p.get(n)) for n in ("D", "Sq", "Sk"))
            and isinstance(p.get("causal", False), bool) and isinstance(p.get("mask", False), bool)
            and _ms(p.get("wmma_ms")) and _ms(p.get("lt_ms")))


@dataclass(frozen=True)
class Figure:
    """Both paths' times at one measured key length."""

    Sk: int
    lt_ms: float
    wmma_ms: float

    def to_dict(self) -> dict:
        return {"Sk": self.Sk, "lt_ms": self.lt_ms, "wmma_ms": self.wmma_ms}

    @classmethod
    def from_dict(cls, d) -> Figure | None:
        if d is None:
            return None
        if not (isinstance(d, dict) and _pos_int(d.get("Sk")) and _ms(d.get("lt_ms")) and _ms(d.get("wmma_ms"))):
            raise ValueError(f"bad figure {str(d)[:80]!r}")
        return cls(d["Sk"], float(d["lt_ms"]), float(d["wmma_ms"]))

    def __str__(self) -> str:
        lt, w = f"lt {self.lt_ms:.3g} ms", f"wmma {self.wmma_ms:.3g} ms"
        return f"{lt} vs {w}" if self.lt_ms < self.wmma_ms else f"{w} vs {lt}"


@dataclass(frozen=True)
class Rule:
    """For cases of head dim ``D``, ``causal``, with a dense ``mask`` or not, and the query-length bucket ``Sq``
    (a measured query length, or :data:`PREFILL` for Sq = Sk): ``lt`` from key length ``lt_from`` on (None: never).
    ``lt_wins``: the figures at ``lt_from``; ``wmma_wins``: at the longest measured key length below it where the
    fused path was faster."""

    D: int
    causal: bool
    Sq: int | str
    lt_from: int | None
    lt_wins: Figure | None = None
    wmma_wins: Figure | None = None
    mask: bool = False

    def prefers_lt(self, Sk: int) -> bool:
        return self.lt_from is not None and Sk >= self.lt_from

    @property
    def bucket(self) -> str:
        return "Sq=Sk" if self.Sq == PREFILL else f"Sq{self.Sq}"

    def __str__(self) -> str:
        return _rule_text(self)

    def _text(self) -> str:
        where = f"D{self.D}{' causal' if self.causal else ''}{' masked' if self.mask else ''} {self.bucket}"
        figs = [f"{f} at Sk {f.Sk}" for f in (self.lt_wins, self.wmma_wins) if f is not None]
        tail = f" ({'; '.join(figs)})" if figs else ""
        if self.lt_from is None:
            return f"at {where} lt does not win at the longest measured Sk{tail}"
        return f"at {where} lt wins from Sk {self.lt_from}{tail}"

    def to_dict(self) -> dict:
        return {"D": self.D, "causal": self.causal, "mask": self.mask, "Sq": self.Sq, "lt_from": self.lt_from,
                "lt_wins": None if self.lt_wins is None else self.lt_wins.to_dict(),
                "wmma_wins": None if self.wmma_wins is None else self.wmma_wins.to_dict()}

    @classmethod
    def from_dict(cls, d) -> Rule:
        """A rule from its stored form; ValueError naming what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"a rule must be an object, got {str(d)[:80]!r}")
        if not (_pos_int(d.get("D")) and isinstance(d.get("causal"), bool) and isinstance(d.get("mask", False), bool)
                and (d.get("Sq") == PREFILL or _pos_int(d.get("Sq")))
                and (d.get("lt_from") is None or _pos_int(d.get("lt_from")))):
            raise ValueError(f"bad rule {str(d)[:120]!r}")
        return cls(d["D"], d["causal"], d["Sq"], d.get("lt_from"), Figure.from_dict(d.get("lt_wins")),
                   Figure.from_dict(d.get("wmma_wins")), d.get("mask", False))


@functools.lru_cache(maxsize=1024)
def _rule_text(rule: Rule) -> str:
    """A rule in words, made once per rule (the selector quotes it on every decode step)."""
    return rule._text()


def derive_rules(points: list[dict]) -> list[Rule]:
    """The rules of measured points (dicts with D, causal, mask, Sq, Sk, wmma_ms, lt_ms; others, e.g. failed
    measurements, are skipped). Buckets per (D, causal, mask): every Sq measured against a longer Sk, each with its
    points (Sq = Sk included), and :data:`PREFILL` with the points where Sq = Sk. In a bucket ``lt_from`` is the
    smallest Sk from which lt is faster (strictly) at every longer measured Sk; None when the fused path is as fast
    or faster at the longest — a point where lt wins below a longer point where it loses does not count."""
    good = [p for p in points if _valid_point(p)]
    groups: dict[tuple, dict[int, dict]] = {}
    numeric = {(p["D"], p.get("causal", False), p.get("mask", False), p["Sq"]) for p in good if p["Sq"] != p["Sk"]}
    for p in good:
        D, causal, mask = p["D"], p.get("causal", False), p.get("mask", False)
        buckets = ([PREFILL] if p["Sq"] == p["Sk"] else []) + \
            ([p["Sq"]] if (D, causal, mask, p["Sq"]) in numeric else [])
        for b in buckets:
            groups.setdefault((D, causal, mask, b), {})[p["Sk"]] = p  # a repeated Sk: the later point
    rules = []
    for (D, causal, mask, b), by_sk in groups.items():
        rows = [by_sk[s] for s in sorted(by_sk)]
        i = len(rows)
        while i > 0 and rows[i - 1]["lt_ms"] < rows[i - 1]["wmma_ms"]:
            i -= 1
        fig = [Figure(p["Sk"], float(p["lt_ms"]), float(p["wmma_ms"])) for p in rows]
        rules.append(Rule(D, causal, b, rows[i]["Sk"] if i < len(rows) else None,
                          fig[i] if i < len(rows) else None, fig[i - 1] if i > 0 else None, mask))
    return sorted(rules, key=lambda r: (r.D, r.mask, r.causal, r.Sq == PREFILL, 0 if r.Sq == PREFILL else r.Sq))


# ---- a calibration and its lookup ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Calibration:
    """One usable calibration: measured rules, or one threshold for every case (``threshold``; a v1 entry)."""

    origin: str  # "this GPU" (calibration.json) or "shipped" (package data)
    gpu: str
    date: str | None
    rules: tuple[Rule, ...] = ()
    threshold: int | None = None
    # rule_for's answers, per (D, causal, Sq, Sq >= Sk, mask): a decode step asks on every new key length
    _found: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @functools.cached_property
    def source(self) -> str:
        """Where the figures come from, in words."""
        if self.threshold is not None:
            return "measured on this GPU by attn-lt calibrate" if self.origin == "this GPU" else \
                f"shipped calibration of the {self.gpu}"
        when = f", {self.date}" if self.date else ""
        if self.origin == "this GPU":
            return f"measured on this GPU ({self.gpu}{when})"
        return f"shipped calibration, measured on the {self.gpu}{when}"

    def rule_for(self, D: int, causal: bool, Sq: int, Sk: int, mask: bool = False) -> Rule | None:
        """The rule of a case: head dim ``D`` measured (else None), and with ``mask`` the masked rules only (a
        calibration without them decides no masked case); with ``Sq >= Sk`` the prefill rule when there is one;
        else the nearest measured query length at or below ``Sq`` (a causal case below every causal bucket, or
        masked, takes the non-causal rule); None when no bucket is at or below ``Sq``."""
        key = (D, causal, Sq, Sq >= Sk, mask)
        try:
            return self._found[key]
        except KeyError:
            rule = self._found[key] = self._rule_for(D, causal, Sq, Sk, mask)
            return rule

    def _rule_for(self, D: int, causal: bool, Sq: int, Sk: int, mask: bool) -> Rule | None:
        for c in (causal, False) if causal else (False,):
            rules = [r for r in self.rules if r.D == D and r.causal == c and r.mask == mask]
            if Sq >= Sk:
                pre = [r for r in rules if r.Sq == PREFILL]
                if pre:
                    return pre[0]
            below = [r for r in rules if r.Sq != PREFILL and r.Sq <= Sq]
            if below:
                return max(below, key=lambda r: r.Sq)
        return None


def _entry_calibration(entry, origin: str, gpu: str, where: str) -> Calibration | None:
    """The calibration of a stored entry, or None (reported) when it cannot be used."""
    if not isinstance(entry, dict):
        log.warning("attn_lt: the calibration of the %s in %s is not an object; ignoring it", gpu, where)
        return None
    date = entry.get("date")
    date = date if isinstance(date, str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", date) else None
    if "rules" in entry:
        try:
            if not isinstance(entry["rules"], list):
                raise ValueError("rules must be a list")
            rules = tuple(Rule.from_dict(r) for r in entry["rules"])
            if len({(r.D, r.causal, r.mask, r.Sq) for r in rules}) != len(rules):
                raise ValueError("two rules for one (D, causal, mask, Sq)")
        except ValueError as e:
            log.warning("attn_lt: the calibration of the %s in %s is unusable (%s); ignoring it", gpu, where, e)
            return None
        return Calibration(origin, gpu, date, rules)
    t = entry.get("threshold")
    if _pos_int(t):
        return Calibration(origin, gpu, date, threshold=t)
    log.warning("attn_lt: the calibration of the %s in %s has neither rules nor a threshold; ignoring it", gpu, where)
    return None


# ---- files ---------------------------------------------------------------------------------------------------

def path() -> Path:
    """This user's calibration file (in the cache directory)."""
    return config.cache_dir() / FILE


def _read(p: Path, what: str = "calibration file") -> dict | None:
    """The document at ``p`` as stored (any version); None when missing or when anything makes it unreadable (a
    FIFO, a device, a directory, a symlink loop, a huge or malformed file: reported), never raises."""
    from .cache import CacheError, read_regular_file

    if not os.path.lexists(p):
        return None
    try:
        doc = json.loads(read_regular_file(p, MAX_FILE_BYTES).decode("utf-8"))
    except CacheError as e:
        log.warning("attn_lt: cannot read the %s (%s); ignoring it", what, e)
        return None
    except (OSError, ValueError, RecursionError) as e:
        log.warning("attn_lt: cannot read the %s %s (%s); ignoring it", what, p, e)
        return None
    if isinstance(doc, dict) and doc.get("schema") == SCHEMA and isinstance(doc.get("thresholds"), dict):
        return doc
    log.warning("attn_lt: %s is not a calibration file; ignoring it", p)
    return None


def _empty() -> dict:
    return {"schema": SCHEMA, "version": VERSION, "thresholds": {}}


def _version(doc: dict) -> int:
    v = doc.get("version", 1)
    return v if _pos_int(v) else NEVER


def read(p: Path | None = None) -> dict:
    """The calibration document at ``p`` (default :func:`path`): ``{"schema", "version", "thresholds": {key:
    entry}}``; empty when missing, unreadable or written by a newer attn_lt (reported); never raises."""
    p = path() if p is None else p
    doc = _read(p)
    if doc is not None and _version(doc) > VERSION:
        log.warning("attn_lt: %s was written by a newer attn_lt (version %r); ignoring it", p, doc.get("version"))
        doc = None
    return _empty() if doc is None else doc


def _dumps(o, indent: str = "") -> str:
    """JSON with one point or rule a line (files that are read in diffs), objects of objects spread out."""
    inner = indent + " "
    if isinstance(o, dict) and any(isinstance(v, (dict, list)) and v for v in o.values()):
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, inner)}" for k, v in o.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(o, list) and any(isinstance(v, (dict, list)) for v in o):
        return "[\n" + ",\n".join(inner + json.dumps(v) for v in o) + "\n" + indent + "]"
    return json.dumps(o)


def _write(p: Path, doc: dict) -> None:
    """Write ``doc`` to ``p`` by an atomic replace; raises OSError/ValueError/TypeError (no temporary left)."""
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "w") as f:
            f.write(_dumps(doc) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        tmp = None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def make_entry(points: list[dict], gpu: str, cc: str, date: str | None = None, **info) -> dict:
    """A measured entry: the GPU, the date (UTC today by default), ``info`` (e.g. the grid, the attn_lt version,
    the seconds it took), the rules derived from ``points``, and the points."""
    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return {"gpu": gpu, "cc": cc, "date": date, **info, "rules": [r.to_dict() for r in derive_rules(points)],
            "points": points}


def merged(old, new: dict) -> dict:
    """``new`` (a measured entry of some head dims, its ``grid["dims"]``) over ``old`` (the entry it updates, or
    None): the points of ``old``'s other head dims kept (and of a head dim none of whose new points is valid), the
    rules derived again from all of them. What ``attn-lt calibrate --dims`` writes, so that measuring one head dim
    again keeps the others' rules. The entry's other fields (date, grid lengths, seconds) are the new run's."""
    dims = set((new.get("grid") or {}).get("dims") or ())
    if not isinstance(old, dict) or not isinstance(old.get("points"), list) or not dims:
        return new
    measured = {p["D"] for p in new.get("points") or () if _valid_point(p)}
    kept = [p for p in old["points"] if _valid_point(p) and p["D"] not in measured]
    points = kept + list(new["points"])
    grid = {**(new.get("grid") or {}), "dims": sorted(dims | {p["D"] for p in kept})}
    return {**new, "grid": grid, "rules": [r.to_dict() for r in derive_rules(points)], "points": points}


def store(env_key: str, entry: dict | int, points: list | None = None, merge: bool = False) -> Path | None:
    """Record the calibration of environment ``env_key`` in this user's file by an atomic replace, keeping the
    other environments' entries. ``entry``: a measured entry (:func:`make_entry`), or an int, one threshold for
    every case (with the ``points`` behind it); ``merge``: keep the stored entry's other head dims
    (:func:`merged`). Returns the file, or None (with a warning saying why) when it could not be written."""
    if isinstance(entry, int) and not isinstance(entry, bool):
        if entry < 1:
            raise ValueError(f"threshold must be >= 1, got {entry}")
        entry = {"threshold": entry, "points": list(points or [])}
    elif not isinstance(entry, dict):
        raise TypeError(f"entry must be a dict (make_entry) or an int threshold, got {type(entry).__name__}")
    p = path()
    doc = _read(p) or _empty()
    if _version(doc) > VERSION:
        log.warning("attn_lt: could not store the calibration in %s (written by a newer attn_lt, version %r; "
                    "left as it is)", p, doc.get("version"))
        return None
    if merge and isinstance(entry, dict):
        entry = merged(doc["thresholds"].get(env_key), entry)
    doc = {**doc, "schema": SCHEMA, "version": VERSION, "thresholds": {**doc["thresholds"], env_key: entry}}
    try:
        _write(p, doc)
    except (OSError, ValueError, TypeError) as e:
        log.warning("attn_lt: could not store the calibration in %s (%s)", p, e)
        return None
    finally:
        clear_cache()
    return p


def shipped_key(gpu: str, cc: str) -> str:
    """The key of a shipped calibration: GPU name and compute capability (``"NVIDIA H100 80GB HBM3|sm9.0"``)."""
    return f"{gpu}|sm{cc}"


def shipped_name(gpu: str, cc: str) -> str:
    """The file name of a shipped calibration, e.g. ``nvidia-h100-80gb-hbm3-sm90.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"
    return f"{slug}-sm{cc.replace('.', '')}.json"


def write_shipped(directory, entry: dict, merge: bool = False) -> Path:
    """Write ``entry`` (:func:`make_entry`, with its ``gpu`` and ``cc``) as a shipped calibration in
    ``directory`` (created if missing), replacing that GPU's file (``merge``: keeping its other head dims,
    :func:`merged`); returns the file. Raises OSError."""
    gpu, cc = entry["gpu"], entry["cc"]
    p = Path(directory) / shipped_name(gpu, cc)
    if merge:
        entry = merged(((_read(p, "shipped calibration") or {}).get("thresholds") or {}).get(shipped_key(gpu, cc)),
                       entry)
    try:
        _write(p, {"schema": SCHEMA, "version": VERSION, "thresholds": {shipped_key(gpu, cc): entry}})
    except (ValueError, TypeError) as e:
        raise OSError(f"could not write {p}: {e}") from e
    finally:
        clear_cache()
    return p


# ---- what applies here ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Gpu:
    """The current device as the calibrations know it: name, compute capability, and the environment key of this
    user's calibration file (GPU and cuBLASLt version), given or found for ``device`` when asked."""

    name: str
    cc: str
    env_key: str | None = None
    device: int | None = None

    def user_key(self) -> str | None:
        """The key of this user's calibration, None without cuBLASLt. Asked only where that file exists: finding
        cuBLASLt's version imports nvmath, which a process whose calls all take the fused path never needs."""
        return self.env_key if self.env_key is not None or self.device is None else _env_key(self.device)


@functools.lru_cache(maxsize=16)
def _env_key(device: int) -> str | None:
    try:
        from .cache import current_env

        return current_env(device).key()
    except Exception:  # no nvmath / cuBLASLt: no environment key (the shipped calibration still applies)
        return None


@functools.lru_cache(maxsize=16)
def _gpu(device: int) -> Gpu:
    import torch

    p = torch.cuda.get_device_properties(device)
    return Gpu(p.name, f"{p.major}.{p.minor}", device=device)


def current_gpu() -> Gpu | None:
    """The current CUDA device (looked up once per device), or None without one (a CPU build of torch; whether
    CUDA is available is asked once per process: ``auto`` asks for the GPU on every decode step)."""
    try:
        dev = current_index()
        return None if dev is None else _gpu(dev)
    except Exception:  # a broken CUDA setup: no GPU, no calibration
        return None


@functools.lru_cache(maxsize=16)
def _load(cache_dir: str, shipped_dir: str, gpu: Gpu) -> tuple[Calibration, ...]:
    cache_dir, shipped_dir = Path(cache_dir), Path(shipped_dir)
    found = []
    p = cache_dir / FILE
    env_key = gpu.user_key() if p.is_file() else None
    if env_key is not None:
        entry = read(p)["thresholds"].get(env_key)
        if entry is not None:
            found.append(_entry_calibration(entry, "this GPU", gpu.name, str(p)))
    p = shipped_dir / shipped_name(gpu.name, gpu.cc)
    doc = _read(p, "shipped calibration")
    if doc is not None and _version(doc) != VERSION:
        log.warning("attn_lt: the shipped calibration %s has version %r, not %d; ignoring it", p,
                    doc.get("version", 1), VERSION)
    elif doc is not None:
        entry = doc["thresholds"].get(shipped_key(gpu.name, gpu.cc))
        if entry is None:
            log.warning("attn_lt: the shipped calibration %s has no entry for %s; ignoring it", p,
                        shipped_key(gpu.name, gpu.cc))
        else:
            found.append(_entry_calibration(entry, "shipped", gpu.name, str(p)))
    return tuple(c for c in found if c is not None)


def calibrations() -> tuple[Calibration, ...]:
    """The calibrations that apply to the current GPU, in order of precedence: this GPU's (``attn-lt
    calibrate``), then the shipped one of this GPU model; empty without a GPU. Read once per (cache directory,
    :data:`SHIPPED_DIR`, GPU)."""
    gpu = current_gpu()
    if gpu is None:
        return ()
    return _load(str(config.cache_dir()), str(SHIPPED_DIR), gpu)  # strings: hashed per call, Paths are slow


def clear_cache() -> None:
    """Forget what was read (the next lookup reads the files again); ``store`` and ``write_shipped`` call it.
    Plans already made by ``attention()`` keep their path (``attn_lt.api.clear_plans`` forgets them)."""
    _load.cache_clear()
