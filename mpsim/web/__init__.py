"""``mpsim serve``: a local web page over the same Python API as the command line.

``inputs`` reads what the page asks for (query strings, uploads), ``jobs`` queues runs
with progress and cancelling, ``worker`` computes them in a worker process, ``work`` says
what each view computes, ``charts`` draws the results with
matplotlib, ``app`` is the HTTP server (the standard library's), ``static/`` the page.
"""
