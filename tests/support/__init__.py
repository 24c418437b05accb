"""Shared test support: the tiny random-weight models (``models``) and the one
reference-compare helper (``compare``)."""
