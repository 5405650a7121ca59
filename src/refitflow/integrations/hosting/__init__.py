"""The engine-neutral hosting layer every engine plug-in stands on: a rank's session behind synchronous calls
(``rank_session``), refitflow's loop on a thread of its own (``loop_thread``), the writers a rank refits with
(``writers``: direct, or the model's own ``load_weights``), a live fused model checked against the layout tables
(``fused_model``), the engine vote's setup (``vote_setup``), the init and update info the RL loop sends (``info``),
the drivers' HTTP and fleet bookkeeping (``http``, ``fleet``), and the one place an integration reads its
environment (``keys``). Nothing here imports an engine.
"""
