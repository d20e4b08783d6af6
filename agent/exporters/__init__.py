"""Exporters: drain the hot-path recorder off the engine's thread into metrics, spans and files.

    recorder.drain() ──► TelemetryPipeline (background thread, bounded queue, counted drops)
                           ├─ RunStoreSink        Parquet parts of the run store
                           ├─ PrometheusExporter  a custom collector on its own registry
                           └─ OtelExporter        one ``kvscope.request`` trace per request

Import the concrete modules (``agent.exporters.pipeline``, ``.prometheus``, ``.otel``,
``.runstore``); this package file imports nothing so that loading one exporter does not load
the others' libraries.
"""
