"""Tessera's common code: settings, bus, messages, subjects, health, logging."""
