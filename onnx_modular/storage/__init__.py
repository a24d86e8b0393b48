"""The file in and out, torch-free: checked loading, atomic journaled saves, locks, signals.

* :mod:`~onnx_modular.storage.load`: checked loading (a protobuf wire scan, then structure checks);
  external data read and checked;
* :mod:`~onnx_modular.storage.checks`: the structure checks (sizes, missing functions, recursion,
  the expanded size of the call tree);
* :mod:`~onnx_modular.storage.save`: the checked model writer (``write_checked``, ``staged_save``),
  reports (``write_text``); re-exports the entry points of commit, destination and folders;
* :mod:`~onnx_modular.storage.commit`: the one journaled atomic commit every write goes through
  (staged files, a journal, the destination lock, all or none);
* :mod:`~onnx_modular.storage.destination`: a destination checked before any work, data-file names,
  the data an existing model refers to;
* :mod:`~onnx_modular.storage.folders`: every output folder, written aside then moved in
  (``publish_folder`` through the commit; ``new_folder`` for a new or empty folder);
* :mod:`~onnx_modular.storage.scratch`: the one scratch-model writer (a model run by onnxruntime, never published);
* :mod:`~onnx_modular.storage.guard`: the writer's guard: no output replaces a file a model reads
  (the input, its external data, another model's data in the destination's folder);
* :mod:`~onnx_modular.storage.limits`: the one home of the bounds on work (stages, runs, modules, ...);
* :mod:`~onnx_modular.storage.manifest`: a split folder's ``manifest.json`` read as untrusted input;
* :mod:`~onnx_modular.storage.locks`: temporary folders next to a destination, the destination lock;
* :mod:`~onnx_modular.storage.signals`: SIGTERM as Ctrl-C, signals deferred through a commit;
* :mod:`~onnx_modular.storage.proto`: walks over ``onnx`` protos (every node, every tensor, ids);
* :mod:`~onnx_modular.storage.display`: sizes as shown to users.
"""
