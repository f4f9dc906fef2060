"""`explore`: a budgeted, deterministic search of P/D settings that turns runs into deduplicated findings.

``space.py`` reads the declared space, ``sample.py`` draws samples from it (boundaries and uncovered values first),
``signature.py`` names what a failed run shows and separates known failures from new ones, ``results.py`` keeps the
results file a killed explore resumes from, and ``cli.py`` runs samples as edge-matrix pairs (docs/explore.md).
"""
