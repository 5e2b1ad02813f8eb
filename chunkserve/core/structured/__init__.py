"""Structured outputs: grammars compiled off the step loop, token bitmasks for the rows that sample."""
