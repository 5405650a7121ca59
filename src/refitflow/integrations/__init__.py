"""Plug-ins for the systems refitflow serves: inference engines (vLLM, SGLang) and RL frameworks
(verl). Each lives in a module of its own, imports its host package lazily, and builds on the
public parts of refitflow (``api``, ``engine``, ``registry``, ``layouts``); nothing in refitflow
imports an integration.
"""
