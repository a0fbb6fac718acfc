//! Each way a mutant's named test can end.

#[test]
fn fails_on_its_named_assertion() {
    let registry = vec![1];
    assert!(registry.is_empty(), "R4: ghost endpoint after {registry:?}");
}

#[test]
fn fails_in_setup_with_another_message() {
    // The named text is printed, but the failure is a setup panic.
    println!("looking for a ghost endpoint");
    let port: Result<u16, String> = Err("address already in use".into());
    port.expect("bind the test server");
}

#[test]
fn aborts() {
    eprintln!("R4: ghost endpoint (printed before the abort)");
    std::process::abort();
}

#[test]
fn hangs() {
    eprintln!("R4: ghost endpoint (printed before the hang)");
    std::thread::sleep(std::time::Duration::from_secs(30));
}

#[test]
fn passes() {}
