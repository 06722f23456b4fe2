"""Every way a result is shown, and nothing that computes one.

``text`` (tables a person reads, with the one table formatter ``table_text``), ``plots``
(matplotlib figures of one job and of the studies), ``html`` (self-contained HTML views:
inline CSS and SVG, no script), ``markdown`` (``reproduce``'s reports as HTML) and
``chrome`` (Perfetto / chrome://tracing timelines). The studies return data; the CLI and
the web page pick a view of it here.
"""
