"""Results: the records a run writes, their checks, the run folder and reading it back.

One job per module: `schema` (field types, checked by pydantic, findings in this
project's words), `records` (the record kinds, their order and merge), `metrics`
(per-stream latencies, percentile), `files` (atomic writes, checked JSON-lines reads),
`csv_out` (the flat CSV) and `runs` (meta.json, ranks' facts, read_run). The names are
re-exported here: `from vcfslm.results import X` is how the rest of vcfslm reads them.
"""

from .csv_out import CSV_FIELDS, records_to_csv
from .files import (
    MAX_PROBLEMS,
    TORN,
    append_record,
    atomic_write_json,
    atomic_write_text,
    read_records,
    read_serve_records,
    write_records,
)
from .metrics import percentile, stream_metrics
from .records import (
    REQUEST_LISTS,
    SERVE_ARRIVALS,
    SERVE_LOAD_KINDS,
    RankWindow,
    ServeRecord,
    WindowRecord,
    finished_scenarios,
    merge_records,
    record_findings,
    serve_record_findings,
)
from .runs import (
    PERCENTILES,
    RANK_FACT_KEYS,
    SERVE_RESULTS,
    MetaMatrix,
    RunFile,
    RunMeta,
    load_run,
    meta_findings,
    rank_summaries,
    read_meta,
    read_rank_facts,
    read_run,
    write_meta,
)
from .schema import SCHEMA_VERSION, Findings, SchemaError, schema_findings

__all__ = [
    "CSV_FIELDS", "MAX_PROBLEMS", "PERCENTILES", "RANK_FACT_KEYS", "REQUEST_LISTS", "SCHEMA_VERSION",
    "SERVE_ARRIVALS", "SERVE_LOAD_KINDS", "SERVE_RESULTS", "TORN", "Findings", "MetaMatrix", "RankWindow",
    "RunFile", "RunMeta", "SchemaError", "ServeRecord", "WindowRecord", "append_record", "atomic_write_json",
    "atomic_write_text", "finished_scenarios", "load_run", "merge_records", "meta_findings", "percentile",
    "rank_summaries", "read_meta", "read_rank_facts", "read_records", "read_run", "read_serve_records",
    "record_findings", "records_to_csv", "schema_findings", "serve_record_findings", "stream_metrics",
    "write_meta", "write_records",
]
