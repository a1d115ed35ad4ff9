"""fmoe: a functional trainer for mixture-of-experts language models.

A model is a list of pure stage functions ``forward(params, inputs, ctx) -> outputs``; fmoe derives
each stage's forward (F), input-gradient (B) and weight-gradient (W) callables, and runs them in the
order a schedule table gives.

The path of one training step through the modules (``fmoe train recipe.toml``), a hop a line:

    cli.main -> cmd_train                   the command line; bad input becomes one line, exit 2
    recipe.load                             the TOML, every field validated, the family looked up
    train.train -> _train                   the run in numbered steps: setup, state, the step loop
      train_setup.setup                     once before the first step: the next 4 lines, model, memory plan
      check.check_family                    every stage once on a tiny batch, before any data
      mesh.build_mesh                       the ("pp", "dp", "cp", "ep") process groups
      train_state.agree_on_resume_point     the newest intact checkpoint, this run's folder lock
      train_data.open_dataset               data.TokenDataset: token shards read through numpy.memmap
      train_state.initial_state             fresh from the seed, or this rank's checkpoint ranges
      train._Loop.run                       per step: batch, step, stop, loss sync, log line, save
      train_data.batch_stream               data.batches from the run's data cursor
      train_step:
        parallel.parallel_step              one step on the mesh (sharding: the layout and canonical
                                            tensors; gather_plan: parameters gathered per unit;
                                            collectives: reductions of the gradients)
          runner.execute (pp = 1)           the micro-batch plan: F of every unit, then B + W back
          interpreter.run_schedule (pp > 1) a schedule table's rows, a handler per action kind
            fb_order, p2p, shared_grads     FB's order; sends of carries; copies' gradients summed
          runner.forward_stage / backward_stage / weight_grads
                                            the one F, B and W sequence of a stage
            stage.forward / backward_input / backward_weight
                                            F, B and W derived from the stage's forward; memory_policy
                                            and offload: what F keeps for B (recompute, host copies)
              stages.<family> -> stages.decoder, layers, moe, primitives -> kernels
                                            the model's pure stage functions and their kernels
        train._update -> optim.step         clip, AdamW on the shards (optim_fused), buffer updates
      metrics_log.MetricsLog, train_clock.Clock
                                            metrics.jsonl lines; steady-state tokens/s and MFU
      train_state.Checkpointer -> checkpoint.begin_save / PendingSave.finish
                                            sharded, atomic, verified; written beside training
                                            (checkpoint_plan, _write, _install, _verify, _lock, _read)
      preemption.StopSignals                SIGTERM / SIGINT / checkpoint.signal end after a step

``fmoe plan`` (plan.py, plan_activations.py, working_set.py: the step's own gather plan replayed)
models the same step's memory from shapes; ``fmoe data`` builds token
shards (data_build.py); ``fmoe checkpoint`` converts to and from Hugging Face (hf.py).
"""

__version__ = "0.1.0"
