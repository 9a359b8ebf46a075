/*
 * Browser test of shoal's web UI against a running node: Debian's chromium, headless, driven
 * by playwright-core. It checks that the cluster view lists the node (id from /v1/cluster),
 * that a chat reply streams in (at least two partial renders before the final one), that the
 * final answer is rendered as markdown with TTFT and tok/s under it, that the conversation
 * survives a reload, and that model-style markdown with HTML in it creates no markup; it saves
 * screenshots in --out. It never starts a node itself (tests/ui.rs does) and downloads nothing.
 *
 *   node tests/browser/chat.mjs --url http://127.0.0.1:PORT/ --out DIR [--timeout-s 240]
 *        [--prompt TEXT] [--max-tokens N] [--api-key K]
 * Exit status 0 when every check passed; a JSON summary goes to stdout, progress to stderr.
 */
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { chromium } from 'playwright-core';

const args = parseArgs(process.argv.slice(2));
const url = args.url || 'http://127.0.0.1:52415/';
const out = args.out || 'target/ui-test-output';
const timeoutS = Number(args['timeout-s'] || 240);
const prompt = args.prompt || 'Write a Python function that adds two numbers. Answer with one short code block.';
const maxTokens = Number(args['max-tokens'] || 48);
const apiKey = args['api-key'] || '';
const chromiumPath = process.env.CHROMIUM || '/usr/bin/chromium';

// The flags this machine kind needs (no sandbox as root, no background network, no GPU).
const CHROMIUM_ARGS = [
  '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
  '--disable-component-update', '--disable-sync', '--disable-dev-shm-usage',
];

const summary = { url, out, checks: [], screenshots: [] };
const log = (...a) => console.error('[chat.mjs]', ...a);
function check(name, ok, detail) {
  summary.checks.push({ name, ok: !!ok, detail });
  log((ok ? 'ok   ' : 'FAIL ') + name + (detail !== undefined ? ': ' + JSON.stringify(detail) : ''));
  if (!ok) throw new Error('check failed: ' + name + (detail !== undefined ? ' (' + JSON.stringify(detail) + ')' : ''));
}

function parseArgs(argv) {
  const o = {};
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (!a.startsWith('--')) throw new Error('unexpected argument ' + a);
    const eq = a.indexOf('=');
    if (eq > 0) o[a.slice(2, eq)] = a.slice(eq + 1);
    else o[a.slice(2)] = argv[++i];
  }
  return o;
}

const watchdog = setTimeout(() => {
  log(`FAIL: the whole test ran past ${timeoutS} s`);
  summary.ok = false;
  summary.error = 'timeout';
  console.log(JSON.stringify(summary, null, 2));
  process.exit(2);
}, timeoutS * 1000);

let browser;
let page;
try {
  mkdirSync(out, { recursive: true });
  const headers = apiKey ? { Authorization: 'Bearer ' + apiKey } : {};
  const cluster = await (await fetch(new URL('/v1/cluster', url), { headers })).json();
  check('/v1/cluster names this node', typeof cluster.self === 'string' && cluster.self.length > 0, cluster.self);
  summary.node = cluster.self;

  // playwright gives every launch a new, empty profile directory of its own.
  browser = await chromium.launch({ executablePath: chromiumPath, headless: true, args: CHROMIUM_ARGS });
  const context = await browser.newContext({ viewport: { width: 1360, height: 860 } });
  page = await context.newPage();
  const pageErrors = [];
  page.on('pageerror', (e) => pageErrors.push(String(e)));
  page.on('console', (m) => { if (m.type() === 'error') log('browser console:', m.text()); });

  // Records every distinct text of the assistant reply while it is still streaming.
  await page.addInitScript(() => {
    window.__partials = [];
    const seen = new Set();
    new MutationObserver(() => {
      const msg = document.querySelector('[data-testid="message-assistant"][data-streaming="true"] [data-testid="message-content"]');
      if (!msg || msg.querySelector('.typing')) return; // the waiting dots are not reply text
      const text = msg.textContent;
      if (text && !seen.has(text)) { seen.add(text); window.__partials.push({ t: performance.now(), len: text.length, text }); }
    }).observe(document, { subtree: true, childList: true, characterData: true });
  });

  await page.goto(url, { waitUntil: 'load' });
  if (apiKey) {
    await page.getByTestId('open-settings').click();
    await page.getByTestId('settings-token').fill(apiKey);
    await page.getByTestId('settings-close').click();
  }

  // Cluster view lists this node.
  const nodeCard = page.locator(`[data-testid="cluster-node"][data-node-id="${cluster.self}"]`);
  await nodeCard.waitFor({ state: 'visible', timeout: 20_000 });
  check('cluster view lists the node', await nodeCard.count() === 1, cluster.self);
  check('node card shows a memory bar', await nodeCard.locator('[role="meter"]').count() >= 1);
  if (Array.isArray(cluster.plans) && cluster.plans.length) {
    const plan = page.getByTestId('cluster-plan').first();
    await plan.waitFor({ timeout: 10_000 });
    check('plan shows its strategy', (await plan.getByTestId('plan-strategy').innerText()).trim() === cluster.plans[0].strategy, cluster.plans[0].strategy);
  }

  // A loaded model is picked.
  await page.waitForFunction(() => {
    const o = document.querySelector('[data-testid="model-select"] option:checked');
    return o && o.dataset.loaded === 'true';
  }, null, { timeout: 120_000 });
  summary.model = await page.getByTestId('model-select').inputValue();
  check('model picker selects a loaded model', !!summary.model, summary.model);

  // Settings: greedy, short replies.
  await page.getByTestId('open-settings').click();
  await page.getByTestId('settings-temperature').fill('0');
  await page.getByTestId('settings-max-tokens').fill(String(maxTokens));
  await page.getByTestId('settings-close').click();

  // Chat: Enter sends.
  const input = page.getByTestId('chat-input');
  await input.fill(prompt);
  await input.press('Enter');
  const reply = page.getByTestId('message-assistant').last();
  await reply.waitFor({ timeout: 10_000 });
  check('user message shown', (await page.getByTestId('message-user').last().innerText()).includes(prompt.slice(0, 20)));
  await page.getByTestId('stop-button').waitFor({ state: 'visible', timeout: 5_000 });
  await page.locator('[data-testid="message-assistant"][data-streaming="false"]').last().waitFor({ timeout: (timeoutS - 30) * 1000 });

  const partials = await page.evaluate(() => window.__partials);
  const finalText = await reply.getByTestId('message-content').innerText();
  const errorText = await reply.getByTestId('message-error').innerText();
  check('no error under the reply', errorText.trim() === '', errorText);
  check('final answer is non-empty', finalText.trim().length > 0, finalText.slice(0, 200));
  summary.partials = partials.length;
  summary.partialLengths = partials.map((p) => p.len).slice(0, 40);
  // Partials were recorded as textContent; compare like with like.
  const finalLen = await reply.getByTestId('message-content').evaluate((n) => n.textContent.length);
  // (A partial may be longer than the final text: half a closing ``` shows until the rest arrives.)
  const shorter = partials.filter((p) => p.len < finalLen).length;
  check('at least two streamed updates before the final one', shorter >= 2,
    { partials: partials.length, shorterThanFinal: shorter, first: partials[0] && partials[0].len, final: finalLen });
  const rendered = await reply.getByTestId('message-content').evaluate((n) => ({
    elements: Array.from(n.querySelectorAll('*')).map((e) => e.tagName.toLowerCase()),
    code: n.querySelectorAll('pre code').length,
    raw: n.textContent.includes('```'),
  }));
  summary.rendered = { code: rendered.code, tags: [...new Set(rendered.elements)] };
  check('markdown rendered (a code block, no raw fences)', rendered.code >= 1 && !rendered.raw, summary.rendered);
  const stats = await reply.getByTestId('message-stats').innerText();
  summary.stats = stats;
  check('TTFT and tok/s shown under the reply', /TTFT \d+(\.\d+)? s/.test(stats) && /\d+(\.\d+)? tok\/s/.test(stats), stats);
  check('send button back after the reply', await page.getByTestId('send-button').isVisible());

  const shot = join(out, 'ui-chat.png');
  await page.screenshot({ path: shot });
  summary.screenshots.push(shot);

  // Persistence across a reload.
  await page.reload({ waitUntil: 'load' });
  const after = page.getByTestId('message-assistant').last();
  await after.waitFor({ timeout: 10_000 });
  const afterText = await after.getByTestId('message-content').innerText();
  check('conversation persisted across reload', afterText === finalText && (await page.getByTestId('message-user').last().innerText()).includes(prompt.slice(0, 20)));
  check('stats persisted across reload', (await after.getByTestId('message-stats').innerText()) === stats);
  check('conversation listed in the sidebar', await page.getByTestId('conversation-item').count() >= 1);

  // Model output cannot inject markup: render hostile markdown with the page's own renderer.
  const xss = await page.evaluate(() => {
    const hostile = [
      '<img src=x onerror="window.__pwned=1">', '<script>window.__pwned=1</script>',
      '[a](javascript:window.__pwned=1)', '[b](JAVASCRIPT:alert(1))', '[c](&#106;avascript:alert(1))',
      '![i](https://example.invalid/x.png)', '**<b onmouseover=x>**', '`<i>`', '```\n</code></pre><script>1</script>\n```',
      '| <svg onload=x> | b |\n|---|---|\n| <iframe> | c |', '[d](https://ok.example/"onmouseover="x)',
    ].join('\n\n');
    const box = document.createElement('div');
    box.innerHTML = window.ShoalMarkdown.render(hostile);
    const bad = [];
    for (const e of box.querySelectorAll('*')) {
      if (['script', 'img', 'iframe', 'svg', 'b', 'i', 'object', 'embed', 'style'].includes(e.tagName.toLowerCase())) bad.push(e.tagName);
      for (const a of e.attributes) {
        if (a.name.startsWith('on')) bad.push(e.tagName + '@' + a.name);
        if (a.name === 'href' && !/^(https?:|mailto:)/i.test(a.value)) bad.push('href=' + a.value);
      }
    }
    return { bad, pwned: !!window.__pwned };
  });
  check('hostile markdown creates no markup', xss.bad.length === 0 && !xss.pwned, xss);

  // Narrow window: the chat still fits and the cluster panel opens from the top bar.
  await page.setViewportSize({ width: 420, height: 820 });
  await page.getByTestId('toggle-cluster').click();
  await nodeCard.waitFor({ state: 'visible', timeout: 5_000 });
  await page.waitForTimeout(400); // the panel slides in
  const narrow = join(out, 'ui-narrow-cluster.png');
  await page.screenshot({ path: narrow });
  summary.screenshots.push(narrow);
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  check('no horizontal overflow at 420 px', overflow <= 0, overflow);

  check('no uncaught errors in the page', pageErrors.length === 0, pageErrors);
  summary.ok = true;
} catch (e) {
  summary.ok = false;
  summary.error = String(e && e.stack ? e.stack : e);
  log(summary.error);
  if (page) {
    const shot = join(out, 'ui-failure.png');
    await page.screenshot({ path: shot }).then(() => summary.screenshots.push(shot), () => {});
  }
} finally {
  if (browser) await browser.close().catch(() => {});
  clearTimeout(watchdog);
}
writeFileSync(join(out, 'chat-summary.json'), JSON.stringify(summary, null, 2));
console.log(JSON.stringify(summary, null, 2));
process.exit(summary.ok ? 0 : 1);
