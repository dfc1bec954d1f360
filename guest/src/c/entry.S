/* Agent entry and interrupt stubs. The VMM jumps to _start in 64-bit long
 * mode with rdi = &boot_info; the page tables identity-map 0-4 GiB. */
    .section .text.entry, "ax"
    .global _start
_start:
    cli
    lea     stack_top(%rip), %rsp   /* our own stack, inside the image */
    xor     %ebp, %ebp
    call    agent_main              /* never returns: it ends with EXIT */
1:  hlt
    jmp     1b

    .text
/* CPU exceptions 0-31: one 16-byte stub each (agent.c computes the address
 * as exc_stubs + 16 * vector). Stubs push a zero where the CPU pushes no
 * error code, so the frame is the same for all: vector, error, rip, ... */
    .balign 16
    .global exc_stubs
exc_stubs:
    .irp v, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31
    .balign 16
    .if !(\v == 8 || (\v >= 10 && \v <= 14) || \v == 17 || \v == 21 || \v == 29 || \v == 30)
    push    $0
    .endif
    push    $\v
    jmp     exc_common
    .endr

exc_common:
    mov     (%rsp), %rdi            /* vector */
    mov     16(%rsp), %rsi          /* faulting rip */
    mov     %cr2, %rdx              /* page-fault address */
    and     $-16, %rsp
    call    exception_handler       /* reports ERROR, never returns */

/* Device interrupt: the waiting code looks at the device itself after the
 * wakeup, so the handler only signals end-of-interrupt to the LAPIC. */
    .balign 16
    .global irq_stub
irq_stub:
    push    %rax
    movabs  $0xfee000b0, %rax       /* LAPIC EOI */
    movl    $0, (%rax)
    pop     %rax
    iretq

/* LAPIC timer: counts ticks, which bound every wait. */
    .balign 16
    .global timer_stub
timer_stub:
    lock incq timer_ticks(%rip)
    jmp     irq_stub

    .balign 16
    .global spurious_stub
spurious_stub:
    iretq                           /* no EOI for spurious interrupts */

    .section .bss
    .balign 16
stack:
    .skip   16384
stack_top:
