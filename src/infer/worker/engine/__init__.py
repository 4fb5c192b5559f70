"""The engine core of one DP rank, in-process: EngineConfig, requests, the paged KV bookkeeping and the scheduler
(torch-free), one step's ForwardBatch, attention, LoRA, images and sampling, the model runner and its step graphs,
and the Engine that ties them (intake, the step, output processing, its weights over its life). It imports no zmq
and neither parallel/ nor service/: a pipeline's stage 0 and a TP group's command channel reach it as the Stage and
Followers protocols it declares."""
