// llamacpp-reference.mjs — produce llama.cpp reference outputs (greedy token ids) for shoal's tests.
//
// Run through scripts/llamacpp-reference.sh, which installs node-llama-cpp@3.22.1 into
// scripts/.llamacpp/ and fetches the models. Direct use:
//
//   node scripts/llamacpp-reference.mjs --out tests/fixtures/llamacpp/greedy.json \
//       gemma3-270m=/path/to/gemma/model.gguf qwen2.5-coder-1.5b=/path/to/qwen/model.gguf
//
// Options: --out FILE (JSON fixture; omitted = print to stdout), --no-bench (skip timing),
//          --bench-only (only timing, no fixture), --threads N (default 2).
//
// What it does, per model, on CPU only (prebuilt llama.cpp binaries, gpu: false):
//   * raw completion prompts (no chat template): tokenized exactly like llama.cpp's
//     common_tokenize(text, add_special = true, parse_special = true): BOS prepended iff
//     llama_vocab_get_add_bos(), EOS appended iff llama_vocab_get_add_eos();
//   * 16 greedy tokens (temperature 0 -> llama_sampler_init_greedy, no repetition penalty,
//     no top-k/top-p; EOG tokens are yielded and generation continues past them, and
//     the position of any EOG token is recorded);
//   * qwen only: one chat prompt rendered with the GGUF's embedded jinja chat template by
//     llama.cpp's native jinja engine (common/jinja, via node-llama-cpp's AddonJinjaRenderer)
//     with messages=[{role:user}], add_generation_prompt=true, bos_token/eos_token — the
//     same inputs llama.cpp's common_chat_templates_apply gives the template;
//   * throughput: prompt processing of a 256-token prompt and decode of 128 tokens with
//     N threads (printed to stderr/stdout, not stored in the JSON).
import fs from "node:fs";
import path from "node:path";
import process from "node:process";
// node-llama-cpp lives in scripts/.llamacpp/ (npm install --prefix), outside node's resolution path.
const NLC_DIR = process.env.NODE_LLAMA_CPP_DIR
    ?? new URL("./.llamacpp/node_modules/node-llama-cpp/", import.meta.url).pathname;
const { getLlama, LlamaLogLevel, JinjaTemplateChatWrapper } =
    await import(new URL("dist/index.js", `file://${path.resolve(NLC_DIR)}/`).href);

const RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4, 5,"
];
const CHAT_MODELS = new Set(["qwen2.5-coder-1.5b"]);
const CHAT_USER_MESSAGE = "Write a haiku about the sea.";
const N_GEN = 16;

// ---------- args ----------
let outPath = null;
let bench = true;
let benchOnly = false;   // only the throughput measurement; no fixture written
let threads = 2;
const models = [];
{
    const argv = process.argv.slice(2);
    for (let i = 0; i < argv.length; i++) {
        const a = argv[i];
        if (a === "--out") outPath = argv[++i];
        else if (a === "--no-bench") bench = false;
        else if (a === "--bench-only") benchOnly = true;
        else if (a === "--threads") threads = Number(argv[++i]);
        else if (a.includes("=")) {
            const [id, file] = [a.slice(0, a.indexOf("=")), a.slice(a.indexOf("=") + 1)];
            models.push({ id, file });
        } else {
            console.error(`unknown argument: ${a}`);
            process.exit(2);
        }
    }
    if (models.length === 0) {
        console.error("usage: node llamacpp-reference.mjs [--out FILE] [--no-bench] [--threads N] ID=MODEL.gguf ...");
        process.exit(2);
    }
}

const log = (...args) => console.error("[llamacpp-reference]", ...args);

const llama = await getLlama({
    gpu: false,
    build: "never",          // prebuilt binaries only, never compile
    maxThreads: threads,
    logLevel: LlamaLogLevel.error,
    progressLogs: false
});
const pkgVersion = JSON.parse(fs.readFileSync(path.join(NLC_DIR, "package.json"), "utf8")).version;
const rel = llama.llamaCppRelease;
const LLAMA_CPP_VERSION = `node-llama-cpp ${pkgVersion} (${llama.buildType}), llama.cpp ${rel.repo}@${rel.release}, CPU`;
log(LLAMA_CPP_VERSION);
log("system info:", llama.systemInfo);

function llamaCppTokenize(model, text) {
    // == common_tokenize(vocab, text, add_special=true, parse_special=true)
    const ids = [];
    if (model.tokens.shouldPrependBosToken && model.tokens.bos != null) ids.push(model.tokens.bos);
    ids.push(...model.tokenize(text, true));
    if (model.tokens.shouldAppendEosToken && model.tokens.eos != null) ids.push(model.tokens.eos);
    return ids;
}

async function greedy(sequence, promptIds, nTokens) {
    await sequence.clearHistory();
    const out = [];
    const gen = sequence.evaluate(promptIds, {
        temperature: 0,      // -> llama_sampler_init_greedy(); top-k/top-p/min-p unused
        yieldEogToken: true  // do not stop on EOS/EOT: keep generating, record it instead
    });
    for await (const tok of gen) {
        out.push(tok);
        if (out.length >= nTokens) break;
    }
    await gen.return?.();
    return out;
}

function hrSeconds(t0) {
    return Number(process.hrtime.bigint() - t0) / 1e9;
}

async function benchmark(model, modelId) {
    const context = await model.createContext({
        contextSize: 1024, batchSize: 512, threads: { ideal: threads, min: threads }, sequences: 1
    });
    const sequence = context.getSequence();
    try {
        // 256-token prompt: BOS (if the model wants one) + text tokens, truncated/padded to 256.
        const filler = "The quick brown fox jumps over the lazy dog. " +
            "In the beginning the Universe was created. This has made a lot of people very angry " +
            "and been widely regarded as a bad move. ";
        let ids = llamaCppTokenize(model, filler.repeat(40));
        ids = ids.slice(0, 256);
        if (ids.length !== 256) throw new Error(`bench prompt has ${ids.length} tokens`);

        // warm-up (page in weights, build graphs)
        await sequence.clearHistory();
        await sequence.evaluateWithoutGeneratingNewTokens(ids.slice(0, 32));

        // Each run records tok/s and the process's CPU utilisation (cpu time / wall time);
        // with N threads on an otherwise idle machine that is close to N. Runs where it is
        // much lower were starved by other processes; the best run is reported.
        const measure = async (fn) => {
            const c0 = process.cpuUsage();
            const t0 = process.hrtime.bigint();
            const n = await fn();
            const wall = hrSeconds(t0);
            const c = process.cpuUsage(c0);
            return { tps: n.count / n.seconds, util: (c.user + c.system) / 1e6 / wall };
        };
        const ppRuns = [];
        for (let r = 0; r < 5; r++) {
            ppRuns.push(await measure(async () => {
                await sequence.clearHistory();
                const t0 = process.hrtime.bigint();
                await sequence.evaluateWithoutGeneratingNewTokens(ids);
                return { count: 256, seconds: hrSeconds(t0) };
            }));
        }

        // decode: short prompt, then time 128 decode steps (tokens 2..129; the first
        // yielded token includes prompt processing and is excluded).
        const tgRuns = [];
        for (let r = 0; r < 3; r++) {
            tgRuns.push(await measure(async () => {
                await sequence.clearHistory();
                const prompt = llamaCppTokenize(model, "Once upon a time");
                const gen = sequence.evaluate(prompt, { temperature: 0, yieldEogToken: true });
                let n = 0;
                let t0 = null;
                let seconds = 0;
                for await (const _tok of gen) {
                    n++;
                    if (n === 1) t0 = process.hrtime.bigint();
                    if (n === 129) { seconds = hrSeconds(t0); break; }
                }
                await gen.return?.();
                return { count: 128, seconds };
            }));
        }
        log(`${modelId}: bench context threads: current=${context.currentThreads} ideal=${context.idealThreads}`);
        const fmt = (xs) => xs.map((x) => `${x.tps.toFixed(1)}@cpu${x.util.toFixed(2)}`).join(", ");
        const best = (xs) => Math.max(...xs.map((x) => x.tps));
        const line = `${modelId}: threads=${threads} pp256 ${best(ppRuns).toFixed(1)} tok/s, ` +
            `tg128 ${best(tgRuns).toFixed(1)} tok/s   [runs tok/s@cpu-utilisation: pp ${fmt(ppRuns)}; tg ${fmt(tgRuns)}]`;
        console.log(`[bench] ${line}`);
        return line;
    } finally {
        await context.dispose();
    }
}

const results = [];
const benchLines = [];
for (const { id: modelId, file } of models) {
    log(`loading ${modelId} from ${file}`);
    const model = await llama.loadModel({ modelPath: file, gpuLayers: 0 });
    const t = model.tokens;
    log(`${modelId}: bos=${t.bos} eos=${t.eos} eot=${t.eot} add_bos=${t.shouldPrependBosToken} ` +
        `add_eos=${t.shouldAppendEosToken} trainCtx=${model.trainContextSize} type="${model.typeDescription}"`);

    if (benchOnly) {
        benchLines.push(await benchmark(model, modelId));
        await model.dispose();
        continue;
    }
    const context = await model.createContext({
        contextSize: 512, batchSize: 512, threads: { ideal: threads, min: threads }, sequences: 1
    });
    const sequence = context.getSequence();

    const cases = RAW_PROMPTS.map((p) => ({ prompt: p, chat: false, rendered: p }));
    if (CHAT_MODELS.has(modelId)) {
        const template = model.fileInfo.metadata?.tokenizer?.chat_template;
        if (typeof template !== "string") throw new Error(`${modelId}: no tokenizer.chat_template in GGUF`);
        const params = {
            messages: [{ role: "user", content: CHAT_USER_MESSAGE }],
            add_generation_prompt: true,
            bos_token: t.bosString ?? "",
            eos_token: t.eosString ?? ""
        };
        // llama.cpp's own jinja engine (common/jinja), as used by llama-server / llama-cli --jinja.
        const native = new llama._bindings.AddonJinjaRenderer(template);
        const renderedNative = native.render(params);
        // node-llama-cpp's chat-wrapper path, for cross-checking only.
        let renderedWrapper = null;
        try {
            const wrapper = new JinjaTemplateChatWrapper({ template, tokenizer: model.tokenizer });
            const state = wrapper.generateContextState({
                chatHistory: [
                    { type: "user", text: CHAT_USER_MESSAGE },
                    { type: "model", response: [] }
                ]
            });
            renderedWrapper = state.contextText.toString();
        } catch (e) {
            renderedWrapper = `<error: ${e?.message ?? e}>`;
        }
        if (renderedWrapper !== renderedNative) {
            log(`${modelId}: NOTE node-llama-cpp JinjaTemplateChatWrapper renders differently from llama.cpp's jinja:`);
            log("  native :", JSON.stringify(renderedNative));
            log("  wrapper:", JSON.stringify(renderedWrapper));
        } else {
            log(`${modelId}: JinjaTemplateChatWrapper and native jinja render identically`);
        }
        cases.push({ prompt: CHAT_USER_MESSAGE, chat: true, rendered: renderedNative });
    }

    for (const c of cases) {
        const promptIds = llamaCppTokenize(model, c.rendered);
        const generated = await greedy(sequence, promptIds, N_GEN);
        if (generated.length !== N_GEN) throw new Error(`${modelId}: generated only ${generated.length} tokens`);
        const eog = generated.map((tok, i) => (model.isEogToken(tok) ? i : -1)).filter((i) => i >= 0);
        const text = model.detokenize(generated, false, promptIds);
        const entry = {
            model: modelId,
            prompt: c.prompt,
            chat: c.chat,
            rendered_prompt: c.rendered,
            prompt_ids: promptIds,
            generated_ids: generated,
            generated_text: text,
            llama_cpp: LLAMA_CPP_VERSION,
            // extras (informational): what llama.cpp did around special tokens
            add_bos: t.shouldPrependBosToken,
            add_eos: t.shouldAppendEosToken,
            eog_positions: eog
        };
        results.push(entry);
        log(`${modelId} ${c.chat ? "[chat]" : "[raw]"} ${JSON.stringify(c.prompt)} -> ${JSON.stringify(text)}` +
            (eog.length ? ` (EOG at ${eog.join(",")})` : ""));
    }
    await context.dispose();

    if (bench) benchLines.push(await benchmark(model, modelId));
    await model.dispose();
}

// Pretty-print, but keep arrays of token ids on one line (placeholders, so strings are untouched).
const compactArrays = [];
const json = JSON.stringify(results, (_k, v) => {
    if (Array.isArray(v) && v.every(Number.isInteger)) {
        compactArrays.push(`[${v.join(", ")}]`);
        return `\u0000ARR${compactArrays.length - 1}\u0000`;
    }
    return v;
}, 2).replace(/"\\u0000ARR(\d+)\\u0000"/g, (_m, i) => compactArrays[Number(i)]) + "\n";
if (JSON.stringify(JSON.parse(json)) !== JSON.stringify(results)) throw new Error("JSON formatting bug");
if (benchOnly) {
    // nothing to write
} else if (outPath) {
    fs.mkdirSync(path.dirname(outPath), { recursive: true });
    const tmp = `${outPath}.tmp.${process.pid}`;
    fs.writeFileSync(tmp, json);
    fs.renameSync(tmp, outPath);
    log(`wrote ${results.length} entries to ${outPath}`);
} else {
    process.stdout.write(json);
}
if (benchLines.length) {
    console.error("\nthroughput (llama.cpp, CPU):");
    for (const l of benchLines) console.error("  " + l);
}
await llama.dispose();
