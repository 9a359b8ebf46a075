//! The double-click launchers built by `scripts/make-launchers.sh`: the macOS bundle's layout
//! and Info.plist (parsed by python3's plistlib), the Linux desktop entry (desktop-file-validate
//! when present, and parsed here), and the launcher script actually run: the desktop entry's
//! Exec starts a real `shoal serve` on loopback and "opens" the UI through a stub xdg-open on
//! PATH; the .app's and .command's scripts run the same way with a stub `uname` saying Darwin
//! and a stub `open`; a node that fails to start is reported, not waited for. Nothing here
//! runs on a Mac (Finder, Terminal, Gatekeeper are untested).

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::ui::{free_port, healthy, wait_down, wait_healthy, wait_with_deadline, ChildGuard};
use crate::util::{repo_root, shoal_bin};

fn make_launchers(out: &Path) {
    let status = Command::new(repo_root().join("scripts/make-launchers.sh"))
        .arg("--out")
        .arg(out)
        .stdout(Stdio::null())
        .status()
        .expect("scripts/make-launchers.sh runs");
    assert!(status.success(), "scripts/make-launchers.sh failed: {status}");
}

fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// The groups of a desktop entry file: group name -> key -> value.
fn parse_desktop(text: &str) -> HashMap<String, HashMap<String, String>> {
    let mut groups: HashMap<String, HashMap<String, String>> = HashMap::new();
    let mut current = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            assert!(!groups.contains_key(name), "group [{name}] appears twice");
            groups.insert(name.to_string(), HashMap::new());
            current = Some(name.to_string());
            continue;
        }
        let (key, value) = line.split_once('=').unwrap_or_else(|| panic!("not a key=value line: {line}"));
        let group = current.as_ref().unwrap_or_else(|| panic!("key before any group: {line}"));
        let prev = groups.get_mut(group).expect("group exists").insert(key.trim().to_string(), value.trim().to_string());
        assert!(prev.is_none(), "key {key} repeated in [{group}]");
    }
    groups
}

/// An Exec value split into arguments per the desktop entry spec (double quotes, backslash
/// escapes inside them), with field codes such as %U dropped.
fn exec_argv(exec: &str) -> Vec<String> {
    let mut args = Vec::new();
    let mut cur = String::new();
    let mut in_quotes = false;
    let mut has = false;
    let mut chars = exec.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                in_quotes = !in_quotes;
                has = true;
            }
            '\\' if in_quotes => cur.extend(chars.next()),
            ' ' if !in_quotes => {
                if has {
                    args.push(std::mem::take(&mut cur));
                    has = false;
                }
            }
            _ => {
                cur.push(c);
                has = true;
            }
        }
    }
    assert!(!in_quotes, "unbalanced quotes in Exec={exec}");
    if has {
        args.push(cur);
    }
    args.retain(|a| !(a.len() == 2 && a.starts_with('%')));
    args
}

/// A scratch HOME, a stub directory first on PATH, and the environment the launcher sees.
struct Sandbox {
    dir: tempfile::TempDir,
    port: u16,
}

impl Sandbox {
    /// `stubs`: (name, body) of scripts put first on PATH; `$OPENED` is the record file.
    fn new(stubs: &[(&str, &str)]) -> Sandbox {
        let dir = tempfile::tempdir().expect("temp dir");
        let bin = dir.path().join("stubs");
        std::fs::create_dir_all(&bin).expect("stub dir");
        std::fs::create_dir_all(dir.path().join("home")).expect("home dir");
        for (name, body) in stubs {
            let path = bin.join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write stub");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod stub");
        }
        Sandbox { dir, port: free_port() }
    }

    fn home(&self) -> PathBuf {
        self.dir.path().join("home")
    }

    fn opened_file(&self) -> PathBuf {
        self.dir.path().join("opened")
    }

    fn opened(&self) -> Vec<String> {
        std::fs::read_to_string(self.opened_file()).unwrap_or_default().lines().map(str::to_string).collect()
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/", self.port)
    }

    /// A command for `program` with only loopback in reach: `--host 127.0.0.1`, a scratch
    /// HOME (so shoal's data dir and the launcher's state land there) and the stubs first.
    fn command(&self, program: &Path) -> Command {
        let mut cmd = Command::new(program);
        cmd.env_clear()
            .env("PATH", format!("{}:/usr/local/bin:/usr/bin:/bin", self.dir.path().join("stubs").display()))
            .env("HOME", self.home())
            .env("OPENED", self.opened_file())
            .env("SHOAL_BIN", shoal_bin())
            .env("SHOAL_PORT", self.port.to_string())
            .env("SHOAL_ARGS", "--host 127.0.0.1 --no-discovery --listen /ip4/127.0.0.1/tcp/0")
            .env("SHOAL_HEALTH_TIMEOUT", "60")
            .stdin(Stdio::null());
        cmd
    }

    /// Runs a launcher to completion within a deadline and asserts it succeeded.
    fn run_ok(&self, mut cmd: Command, what: &str) {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("{what} starts: {e}"));
        let status = wait_with_deadline(&mut child, Duration::from_secs(90));
        let out = child.wait_with_output().expect("launcher output");
        assert!(
            matches!(status, Ok(s) if s.success()),
            "{what}: {status:?}\nstdout: {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Stops a node the launcher left running, whatever happens in the test.
struct PidGuard(PathBuf);

impl Drop for PidGuard {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(&self.0) {
            let _ = Command::new("kill").arg(pid.trim()).status();
        }
    }
}

fn read_pid(path: &Path) -> u32 {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("launcher pid file {}: {e}", path.display()))
        .trim()
        .parse()
        .expect("pid file holds a number")
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ")
}

#[test]
fn bundle_plist_and_desktop_entry_are_valid() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let out = tmp.path().join("launchers");
    make_launchers(&out);
    // Idempotent: a second build over the first gives the same tree.
    make_launchers(&out);

    let app = out.join("Shoal.app/Contents");
    assert!(app.join("MacOS").is_dir() && app.join("Resources").is_dir(), "bundle layout");
    let plist = app.join("Info.plist");
    let script = r#"
import json, plistlib, sys
with open(sys.argv[1], "rb") as f:
    d = plistlib.load(f, fmt=plistlib.FMT_XML)
print(json.dumps(d))
"#;
    let parsed = Command::new("python3").args(["-c", script]).arg(&plist).output().expect("python3 runs");
    assert!(parsed.status.success(), "plistlib rejects Info.plist: {}", String::from_utf8_lossy(&parsed.stderr));
    let keys: serde_json::Value = serde_json::from_slice(&parsed.stdout).expect("plist as JSON");
    for key in [
        "CFBundleExecutable",
        "CFBundleIdentifier",
        "CFBundleName",
        "CFBundleDisplayName",
        "CFBundlePackageType",
        "CFBundleVersion",
        "CFBundleShortVersionString",
        "CFBundleInfoDictionaryVersion",
        "LSMinimumSystemVersion",
    ] {
        assert!(keys[key].as_str().is_some_and(|v| !v.is_empty()), "Info.plist lacks {key}: {keys}");
    }
    assert_eq!(keys["CFBundlePackageType"], "APPL");
    assert_eq!(keys["CFBundleInfoDictionaryVersion"], "6.0");
    let id = keys["CFBundleIdentifier"].as_str().unwrap();
    assert!(id.split('.').count() >= 3 && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-'), "bundle id {id}");
    let exe = app.join("MacOS").join(keys["CFBundleExecutable"].as_str().unwrap());
    assert!(is_executable(&exe), "{} is not an executable file", exe.display());
    assert!(std::fs::read_to_string(&exe).unwrap().starts_with("#!/bin/sh\n"), "bundle executable is a sh script");
    assert_eq!(std::fs::read_to_string(app.join("PkgInfo")).unwrap(), "APPL????");
    let icon = std::fs::read(app.join("Resources").join(keys["CFBundleIconFile"].as_str().expect("CFBundleIconFile"))).expect("the icon file");
    assert!(icon.starts_with(b"icns") && u32::from_be_bytes(icon[4..8].try_into().unwrap()) as usize == icon.len(), "the icon is an icns file");

    let command = out.join("Shoal.command");
    assert!(is_executable(&command), "Shoal.command is executable");
    assert!(std::fs::read_to_string(&command).unwrap().starts_with("#!/bin/sh\n"));
    for script in [&exe, &command] {
        let syntax = Command::new("sh").arg("-n").arg(script).status().expect("sh runs");
        assert!(syntax.success(), "{} has a shell syntax error", script.display());
    }

    let desktop = out.join("shoal.desktop");
    if let Ok(status) = Command::new("desktop-file-validate").arg(&desktop).status() {
        assert!(status.success(), "desktop-file-validate rejects {}", desktop.display());
    } else {
        eprintln!("[launchers] desktop-file-validate not installed; parsing only");
    }
    let groups = parse_desktop(&std::fs::read_to_string(&desktop).expect("read shoal.desktop"));
    let entry = &groups["Desktop Entry"];
    assert_eq!(entry["Type"], "Application");
    assert_eq!(entry["Name"], "Shoal");
    assert_eq!(entry["Terminal"], "false");
    let argv = exec_argv(&entry["Exec"]);
    assert_eq!(argv.len(), 1, "Exec runs the launcher with no arguments: {argv:?}");
    assert!(Path::new(&argv[0]).is_absolute() && is_executable(Path::new(&argv[0])), "Exec program {argv:?}");
    assert!(Path::new(&entry["Icon"]).exists(), "Icon {} exists", entry["Icon"]);
    let stop = exec_argv(&groups["Desktop Action stop"]["Exec"]);
    assert_eq!(stop, vec![argv[0].clone(), "--stop".to_string()]);
}

#[test]
fn linux_desktop_launcher_starts_a_node_and_opens_the_ui() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let out = tmp.path().join("launchers");
    make_launchers(&out);
    let groups = parse_desktop(&std::fs::read_to_string(out.join("shoal.desktop")).unwrap());
    let argv = exec_argv(&groups["Desktop Entry"]["Exec"]);
    let stop_argv = exec_argv(&groups["Desktop Action stop"]["Exec"]);

    let sb = Sandbox::new(&[("xdg-open", r#"echo "$1" >> "$OPENED""#)]);
    let pidfile = sb.home().join(format!(".local/state/shoal/shoal-{}.pid", sb.port));
    let _cleanup = PidGuard(pidfile.clone());
    assert!(!healthy(sb.port), "port {} already answers", sb.port);

    let started = Instant::now();
    let mut cmd = sb.command(Path::new(&argv[0]));
    cmd.args(&argv[1..]);
    sb.run_ok(cmd, "the desktop entry's Exec");
    eprintln!("[launchers] desktop launcher returned after {:?}", started.elapsed());
    assert_eq!(sb.opened(), vec![sb.url()], "xdg-open got the UI's URL once");
    assert!(healthy(sb.port), "the node answers /health after the launcher returned");
    let pid = read_pid(&pidfile);
    assert!(alive(pid), "the node ({pid}) runs on in the background");
    let (status, page) = crate::ui::http_get(sb.port, "/").expect("GET /");
    assert_eq!(status, 200, "the node serves the UI at /");
    assert!(page.contains("data-testid=\"cluster-view\""), "the UI page is web/index.html");

    // Launching again while it runs opens the browser again and starts nothing new.
    let mut again = sb.command(Path::new(&argv[0]));
    again.args(&argv[1..]);
    sb.run_ok(again, "the launcher, second time");
    assert_eq!(sb.opened(), vec![sb.url(), sb.url()]);
    assert_eq!(read_pid(&pidfile), pid, "no second node was started");

    // The desktop action stops it.
    let mut stop = sb.command(Path::new(&stop_argv[0]));
    stop.args(&stop_argv[1..]);
    sb.run_ok(stop, "the stop action");
    assert!(wait_down(sb.port, Duration::from_secs(15)), "the node stopped answering after --stop");
    assert!(!pidfile.exists(), "--stop removes the pid file");
}

#[test]
fn macos_app_and_command_scripts_under_a_stub_darwin() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let out = tmp.path().join("launchers");
    make_launchers(&out);
    let sb = Sandbox::new(&[
        ("uname", "echo Darwin"),
        ("open", r#"echo "$1" >> "$OPENED""#),
        ("osascript", r#"echo "osascript $*" >> "$OPENED.osascript""#),
    ]);

    // Shoal.app: background node, state under ~/Library/Logs/Shoal, browser through `open`.
    let exe = out.join("Shoal.app/Contents/MacOS/shoal-launcher");
    let pidfile = sb.home().join(format!("Library/Logs/Shoal/shoal-{}.pid", sb.port));
    let _cleanup = PidGuard(pidfile.clone());
    sb.run_ok(sb.command(&exe), "Shoal.app's executable");
    assert_eq!(sb.opened(), vec![sb.url()], "`open` got the UI's URL");
    assert!(healthy(sb.port));
    assert!(sb.home().join("Library/Logs/Shoal/shoal.log").exists(), "the node logs under ~/Library/Logs/Shoal");
    let mut stop = sb.command(&exe);
    stop.arg("--stop");
    sb.run_ok(stop, "Shoal.app's executable --stop");
    assert!(wait_down(sb.port, Duration::from_secs(15)), "the node stopped");

    // Shoal.command: the node runs in the foreground (Terminal's window); the browser opens
    // once it is healthy; ending the process ends the node.
    let mut fg = ChildGuard(sb.command(&out.join("Shoal.command")).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("Shoal.command starts"));
    wait_healthy(sb.port, Duration::from_secs(60), Some(&mut fg.0)).expect("the .command's node answers");
    let start = Instant::now();
    while sb.opened().len() < 2 && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(sb.opened(), vec![sb.url(), sb.url()], "the .command opened the UI");
    assert!(fg.0.try_wait().expect("try_wait").is_none(), "the .command keeps the node in the foreground");
    drop(fg);
    assert!(wait_down(sb.port, Duration::from_secs(15)), "ending the .command ends the node");
}

#[test]
fn launcher_reports_a_node_that_fails_to_start() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let out = tmp.path().join("launchers");
    make_launchers(&out);
    let sb = Sandbox::new(&[("xdg-open", r#"echo "$1" >> "$OPENED""#)]);
    // The real shoal, given a flag it does not know, exits at once.
    let mut cmd = sb.command(&out.join("shoal-launcher"));
    cmd.env("SHOAL_ARGS", "--host 127.0.0.1 --no-such-flag").stdout(Stdio::piped()).stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = cmd.spawn().expect("launcher starts");
    let status = wait_with_deadline(&mut child, Duration::from_secs(30)).expect("the launcher gives up quickly");
    let output = child.wait_with_output().expect("launcher output");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!status.success(), "the launcher reports failure; stderr: {stderr}");
    assert!(started.elapsed() < Duration::from_secs(20), "it noticed the exit, not the health timeout");
    assert!(stderr.contains("stopped at start") && stderr.contains("--no-such-flag"), "stderr names the cause: {stderr}");
    assert!(sb.opened().is_empty(), "no browser was opened");
    assert!(!sb.home().join(format!(".local/state/shoal/shoal-{}.pid", sb.port)).exists(), "no pid file is left");
}
