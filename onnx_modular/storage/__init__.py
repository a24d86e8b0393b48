"""The file in and out, torch-free: checked loading, atomic journaled saves, locks, signals.

* :mod:`~onnx_modular.storage.load`: checked loading (a protobuf wire scan, then structure checks);
  external data read and checked;
* :mod:`~onnx_modular.storage.checks`: the structure checks (sizes, missing functions, recursion,
  the expanded size of the call tree);
* :mod:`~onnx_modular.storage.save`: the one atomic save every write goes through (staged files,
  a journal, the destination lock, unique data-file names);
* :mod:`~onnx_modular.storage.guard`: the writer's guard: no output replaces a file a model reads
  (the input, its external data, another model's data in the destination's folder);
* :mod:`~onnx_modular.storage.limits`: the one home of the bounds on work (stages, runs, modules, ...);
* :mod:`~onnx_modular.storage.manifest`: a split folder's ``manifest.json`` read as untrusted input;
* :mod:`~onnx_modular.storage.locks`: temporary folders next to a destination, the destination lock;
* :mod:`~onnx_modular.storage.signals`: SIGTERM as Ctrl-C, signals deferred through a commit;
* :mod:`~onnx_modular.storage.proto`: walks over ``onnx`` protos (every node, every tensor, ids);
* :mod:`~onnx_modular.storage.display`: sizes as shown to users.
"""
