"""``mpsim serve``: a local web page over the same Python API as the command line.

``inputs`` reads what the page asks for (query strings, uploads), ``jobs`` runs it in a
background thread with progress and cancelling, ``charts`` draws the results with
matplotlib, ``app`` is the HTTP server (the standard library's), ``static/`` the page.
"""
