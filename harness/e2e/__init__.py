"""The e2e command's flags and the run config they build (``config_from_args``), below the command line so that a
package above the run (the nightly's dry run) builds a step's config with the run's own parser and code."""
