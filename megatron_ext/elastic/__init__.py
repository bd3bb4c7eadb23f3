"""Elastic nested submodels (Star Elastic / Nemotron Elastic): see axes.py for the design."""
