"""Adapters that plug distca into training frameworks; each module imports its framework, so
import the one you use (``from distca_client.integrations import hf``)."""
