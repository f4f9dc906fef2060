"""Judging a run: the Check record, output comparison, proof of transfer, failure classification, the smoke check."""
