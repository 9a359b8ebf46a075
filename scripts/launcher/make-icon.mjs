/*
 * Regenerates scripts/launcher/Shoal.icns (the macOS app icon) from web/favicon.svg: Debian's
 * chromium renders the SVG at 128, 256, 512 and 1024 px (transparent background) and the PNGs
 * are packed as icns entries ic07, ic08, ic09 and ic10. The .icns is committed, so
 * make-launchers.sh needs neither node nor a browser; run this only when the SVG changes:
 *   node scripts/launcher/make-icon.mjs      (after npm ci --prefix tests/browser)
 * It does not produce the small 16/32 px variants; macOS scales the large ones down.
 */
import { readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createRequire } from 'node:module';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const require = createRequire(join(root, 'tests/browser/package.json'));
const { chromium } = require('playwright-core');

const svg = readFileSync(join(root, 'web/favicon.svg'), 'utf8');
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync'],
});
const entries = [];
for (const [type, size] of [['ic07', 128], ['ic08', 256], ['ic09', 512], ['ic10', 1024]]) {
  const page = await browser.newPage({ viewport: { width: size, height: size } });
  const sized = svg.replace('<svg ', `<svg width="${size}" height="${size}" `);
  await page.setContent(`<html><body style="margin:0;background:transparent">${sized}</body></html>`);
  const png = await page.screenshot({ omitBackground: true, clip: { x: 0, y: 0, width: size, height: size } });
  const head = Buffer.alloc(8);
  head.write(type, 0, 'latin1');
  head.writeUInt32BE(8 + png.length, 4);
  entries.push(head, png);
  await page.close();
}
await browser.close();
const body = Buffer.concat(entries);
const head = Buffer.alloc(8);
head.write('icns', 0, 'latin1');
head.writeUInt32BE(8 + body.length, 4);
const out = join(root, 'scripts/launcher/Shoal.icns');
writeFileSync(out, Buffer.concat([head, body]));
console.log(out, 8 + body.length, 'bytes');
