"""Helpers shared by the test folders: plain modules the tests and their worker scripts import."""
