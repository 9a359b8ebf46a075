/*
 * shoal web UI: a small, safe Markdown renderer for model output.
 * Every character of the input is HTML-escaped before any tag is added, so model text can
 * never become markup; links are kept only for http(s) and mailto URLs, and images are shown
 * as links (the page never fetches what a model names). It covers what chat models write:
 * fenced code (also unterminated, while streaming), inline code, headings, lists (nested),
 * block quotes, tables, rules, emphasis, strike-through, links and bare URLs. It deliberately
 * does not do raw HTML, reference-style links, footnotes, math or syntax highlighting.
 * Exposes `globalThis.ShoalMarkdown.render(text) -> html string`; no dependencies.
 */
(function () {
  'use strict';

  const ESC = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
  function escapeHtml(s) {
    return String(s).replace(/[&<>"']/g, (c) => ESC[c]);
  }

  // Placeholders keep finished HTML (code spans, links) away from later inline passes.
  const PH_OPEN = '\u0001';
  const PH_CLOSE = '\u0002';

  const UNESC = { '&amp;': '&', '&lt;': '<', '&gt;': '>', '&quot;': '"', '&#39;': "'" };
  function unescapeHtml(s) {
    return s.replace(/&(?:amp|lt|gt|quot|#39);/g, (e) => UNESC[e]);
  }

  // `raw` is already escaped text; the result is the plain URL, or null when not allowed.
  function safeUrl(raw) {
    const url = unescapeHtml(raw.trim());
    return /^(https?:\/\/|mailto:)/i.test(url) ? url : null;
  }

  function link(url, labelHtml) {
    return '<a href="' + escapeHtml(url) + '" target="_blank" rel="noopener noreferrer nofollow">' + labelHtml + '</a>';
  }

  function emphasis(html) {
    return html
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, '<strong>$1</strong>')
      .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, '$1<strong>$2</strong>')
      .replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?!\*)/g, '$1<em>$2</em>')
      .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, '$1<em>$2</em>')
      .replace(/~~(?=\S)([\s\S]*?\S)~~/g, '<del>$1</del>');
  }

  function inline(text) {
    const stash = [];
    const put = (html) => PH_OPEN + (stash.push(html) - 1) + PH_CLOSE;
    let s = String(text).replace(/[\u0001\u0002]/g, '');

    // Code spans: a run of n backticks up to the next run of exactly n.
    let out = '';
    let i = 0;
    while (i < s.length) {
      const tick = s.indexOf('`', i);
      if (tick < 0) { out += s.slice(i); break; }
      let n = 1;
      while (s[tick + n] === '`') n++;
      const fence = '`'.repeat(n);
      let close = -1;
      let from = tick + n;
      while (from <= s.length) {
        const c = s.indexOf(fence, from);
        if (c < 0) break;
        if (s[c + n] !== '`') { close = c; break; }
        from = c + n;
        while (s[from] === '`') from++;
      }
      if (close < 0) { out += s.slice(i, tick + n); i = tick + n; continue; }
      let code = s.slice(tick + n, close);
      if (/^ [\s\S]*[^ ][\s\S]* $/.test(code)) code = code.slice(1, -1);
      out += s.slice(i, tick) + put('<code>' + escapeHtml(code) + '</code>');
      i = close + n;
    }

    s = escapeHtml(out);
    // Images become links: the page loads nothing that model output names.
    s = s.replace(/!\[([^\]]*)\]\(([^()\s]+(?:\([^()\s]*\)[^()\s]*)*)(?:\s+&quot;[\s\S]*?&quot;)?\)/g, (m, alt, url) => {
      const u = safeUrl(url);
      const label = 'image: ' + (alt || url);
      return u ? put(link(u, label)) : label;
    });
    s = s.replace(/\[([^\]]+)\]\(([^()\s]+(?:\([^()\s]*\)[^()\s]*)*)(?:\s+&quot;[\s\S]*?&quot;)?\)/g, (m, label, url) => {
      const u = safeUrl(url);
      return u ? put(link(u, emphasis(label))) : m;
    });
    s = s.replace(/(^|[\s(])(https?:\/\/[^\s<>\u0001\u0002]*[^\s<>.,;:!?)'\u0001\u0002])/g, (m, pre, url) => pre + put(link(unescapeHtml(url), url)));
    s = emphasis(s);
    const restore = /\u0001(\d+)\u0002/g;
    for (let k = 0; k < 8 && restore.test(s); k++) {
      s = s.replace(restore, (m, idx) => stash[Number(idx)]);
    }
    return s;
  }

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:\s+(.*))?$/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  function splitRow(line) {
    let t = line.trim();
    if (t.startsWith('|')) t = t.slice(1);
    if (t.endsWith('|') && !t.endsWith('\\|')) t = t.slice(0, -1);
    const cells = [];
    let cur = '';
    let inCode = false;
    for (let i = 0; i < t.length; i++) {
      const c = t[i];
      if (c === '\\' && t[i + 1] === '|') { cur += '|'; i++; continue; }
      if (c === '`') inCode = !inCode;
      if (c === '|' && !inCode) { cells.push(cur.trim()); cur = ''; continue; }
      cur += c;
    }
    cells.push(cur.trim());
    return cells;
  }

  function startsBlock(line, next) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
      ITEM.test(line) || (line.includes('|') && next !== undefined && TABLE_SEP.test(next) && next.includes('-'));
  }

  function blocks(lines, depth) {
    const html = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (/^\s*$/.test(line)) { i++; continue; }

      let m = line.match(FENCE);
      if (m) {
        const fence = m[1];
        const lang = (m[2] || '').replace(/[^\w+#.-]/g, '').slice(0, 32);
        const indent = line.match(/^ */)[0].length;
        const body = [];
        i++;
        let closed = false;
        while (i < lines.length) {
          const l = lines[i];
          const t = l.trim();
          if (t.length >= fence.length && t[0] === fence[0] && new RegExp('^\\' + fence[0] + '{' + fence.length + ',}$').test(t)) {
            closed = true;
            i++;
            break;
          }
          body.push(indent ? l.replace(new RegExp('^ {0,' + indent + '}'), '') : l);
          i++;
        }
        html.push('<div class="code-block' + (closed ? '' : ' open') + '"><div class="code-head"><span class="code-lang">' +
          escapeHtml(lang || 'text') + '</span><button type="button" class="code-copy" data-testid="code-copy">Copy</button></div><pre><code' +
          (lang ? ' class="language-' + escapeHtml(lang) + '"' : '') + '>' + escapeHtml(body.join('\n')) + '</code></pre></div>');
        continue;
      }

      m = line.match(HEADING);
      if (m) {
        const level = m[1].length;
        html.push('<h' + level + '>' + inline(m[2]) + '</h' + level + '>');
        i++;
        continue;
      }

      if (RULE.test(line)) { html.push('<hr>'); i++; continue; }

      if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && !/^\s*$/.test(lines[i])) {
          const q = lines[i].match(QUOTE);
          inner.push(q ? q[1] : lines[i]);
          i++;
        }
        html.push('<blockquote>' + (depth > 12 ? escapeHtml(inner.join('\n')) : blocks(inner, depth + 1)) + '</blockquote>');
        continue;
      }

      m = line.match(ITEM);
      if (m && !(RULE.test(line))) {
        const baseIndent = m[1].length;
        const ordered = /\d/.test(m[2]);
        const items = [];
        let cur = null;
        let sawBlank = false;
        let loose = false;
        while (i < lines.length) {
          const l = lines[i];
          if (/^\s*$/.test(l)) { sawBlank = true; if (cur) cur.lines.push(''); i++; continue; }
          const im = l.match(ITEM);
          const ind = l.match(/^ */)[0].length;
          if (im && ind <= baseIndent + 1 && /\d/.test(im[2]) === ordered && !RULE.test(l)) {
            if (sawBlank && cur) loose = true;
            cur = { lines: [im[3] || ''], start: ordered ? parseInt(im[2], 10) : null, contentIndent: ind + im[2].length + 1 };
            items.push(cur);
            sawBlank = false;
            i++;
            continue;
          }
          if (ind > baseIndent || (!sawBlank && !startsBlock(l, lines[i + 1]))) {
            const strip = Math.min(ind, cur.contentIndent);
            cur.lines.push(l.slice(strip));
            if (sawBlank && ind > baseIndent) loose = loose || !ITEM.test(l);
            sawBlank = false;
            i++;
            continue;
          }
          break;
        }
        const tag = ordered ? 'ol' : 'ul';
        const startAttr = ordered && items[0].start !== 1 ? ' start="' + items[0].start + '"' : '';
        html.push('<' + tag + startAttr + '>' + items.map((it) => {
          while (it.lines.length && it.lines[it.lines.length - 1] === '') it.lines.pop();
          const inner = depth > 12 ? escapeHtml(it.lines.join('\n')) : blocks(it.lines, depth + 1);
          const tight = !loose ? inner.replace(/^<p>([\s\S]*?)<\/p>/, '$1') : inner;
          return '<li>' + tight + '</li>';
        }).join('') + '</' + tag + '>');
        continue;
      }

      if (line.includes('|') && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes('-')) {
        const head = splitRow(line);
        const aligns = splitRow(lines[i + 1]).map((c) => (c.startsWith(':') && c.endsWith(':') ? 'center' : c.endsWith(':') ? 'right' : c.startsWith(':') ? 'left' : ''));
        i += 2;
        const rows = [];
        while (i < lines.length && lines[i].includes('|') && !/^\s*$/.test(lines[i])) { rows.push(splitRow(lines[i])); i++; }
        const cell = (tagName, text, k) => '<' + tagName + (aligns[k] ? ' style="text-align:' + aligns[k] + '"' : '') + '>' + inline(text) + '</' + tagName + '>';
        html.push('<div class="table-wrap"><table><thead><tr>' + head.map((c, k) => cell('th', c, k)).join('') + '</tr></thead><tbody>' +
          rows.map((r) => '<tr>' + head.map((_, k) => cell('td', r[k] || '', k)).join('') + '</tr>').join('') + '</tbody></table></div>');
        continue;
      }

      const para = [line];
      i++;
      while (i < lines.length && !/^\s*$/.test(lines[i]) && !startsBlock(lines[i], lines[i + 1])) { para.push(lines[i]); i++; }
      html.push('<p>' + para.map((l) => inline(l.trim())).join('<br>') + '</p>');
    }
    return html.join('\n');
  }

  function render(text) {
    const src = String(text == null ? '' : text).replace(/\r\n?/g, '\n').replace(/\t/g, '    ');
    return blocks(src.split('\n'), 0);
  }

  globalThis.ShoalMarkdown = { render, escapeHtml, inline };
})();
