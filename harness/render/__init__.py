"""Pages people read, rendered from what a run or a matrix recorded: a run's report.html (``run_page.py``) and a
matrix's report.html (``matrix_page.py``). Pure over the report's dict (report.json); below ``run/`` and
``matrix/``, which write the pages."""
