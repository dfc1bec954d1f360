/* Agent entry, the switch to CPL3, and the interrupt and exception stubs.
 * The VMM jumps to _start in 64-bit long mode at CPL0 with rdi = &boot_info;
 * its page tables identity-map 0-4 GiB, every page user-accessible.
 *
 * The agent does its work at CPL3 (docs/guest.md, "The agent at CPL3"):
 * kvm_pvm emulates every CPL0 instruction (~0.6 µs each) and runs CPL3 code
 * natively, but an MMIO or port access from CPL3 costs three times one from
 * CPL0. So the agent is a small OS: its loops and packet work run in user
 * mode, and what touches device registers in a row (virtio set-up, the
 * sleep and its interrupt acks, agent-port reports) is a kernel call
 * (`ud2`, ud_stub), as are the GDT, TSS and IDT loads and the stubs that
 * take interrupts and exceptions. On VMX both rings run natively. */

#define SEL_KCODE 0x08
#define SEL_UDATA 0x1b  /* 0x18 | RPL 3 */
#define SEL_UCODE 0x23  /* 0x20 | RPL 3 */
#define SEL_TSS   0x28
#define IDT_GPA   0x1000
#define IDT_GATES 64
/* RFLAGS at CPL3: IOPL 3 (in/out to the agent port and the PIC), bit 1
 * reserved; IF clear until the interrupt set-up (agent.c, k_irq_setup) has
 * masked the legacy PICs, whose default vectors are exception vectors. The
 * agent never executes cli/sti at CPL3. */
#define USER_RFLAGS 0x3002

    .section .text.entry, "ax"
    .global _start
_start:
    cli
    lea     stack_top(%rip), %rsp   /* our own stack, inside the image */
    xor     %ebp, %ebp
    lgdt    gdtr(%rip)
    mov     $SEL_TSS, %ax
    ltr     %ax
    lidt    idtr(%rip)              /* gates filled in by idt_setup (at CPL3) */
    call    agent_main              /* never returns: it ends with EXIT */
1:  hlt
    jmp     1b

    .text
/* enter_user(fn, arg): continue in fn(arg) at CPL3 on the same stack,
 * interrupts off; never returns. */
    .global enter_user
enter_user:
    mov     %rdi, %rax
    mov     %rsi, %rdi
    mov     %rsp, %rcx
    and     $-16, %rcx
    sub     $8, %rcx                /* as after a call: rsp + 8 aligned */
    pushq   $SEL_UDATA
    push    %rcx
    pushq   $USER_RFLAGS
    pushq   $SEL_UCODE
    push    %rax
    iretq

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
    mov     24(%rsp), %rcx          /* its code segment: the ring it ran in */
    and     $-16, %rsp
    call    exception_handler       /* reports ERROR, never returns */

/* #UD. From CPL3 at a `ud2` it is a kernel call (agent.h, kcall): rax(rdi)
 * runs at CPL0 on the TSS stack with interrupts off (interrupt gate), its
 * result in rax, and the caller resumes after the ud2. The caller's asm
 * declares every register the C ABI lets a callee clobber, so none is saved
 * here. Any other #UD is an exception. */
    .balign 16
    .global ud_stub
ud_stub:
    testb   $3, 8(%rsp)             /* saved CS: rip, cs, ... (no error code) */
    jz      1f
    mov     (%rsp), %rcx            /* saved rip */
    cmpw    $0x0b0f, (%rcx)         /* ud2 */
    jne     1f
    addq    $2, (%rsp)
    sub     $8, %rsp                /* 5 words pushed: align the call */
    call    *%rax
    add     $8, %rsp
    iretq
1:  push    $0
    push    $6
    jmp     exc_common

/* Device interrupt: the waiting code looks at the device itself after the
 * wakeup, so the handler counts it (for the agent's sleep, agent.c) and
 * signals end-of-interrupt to the LAPIC. */
    .balign 16
    .global irq_stub
irq_stub:
    push    %rax
    lock incq irq_count(%rip)
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

    .data
    .balign 16
/* Flat segments: kernel code and data (the VMM's 0x08/0x10), user data and
 * 64-bit user code, and the TSS (its base is the linker's, agent.ld). */
gdt:
    .quad   0
    .quad   0x00af9b000000ffff      /* 0x08 code, DPL 0 */
    .quad   0x00cf93000000ffff      /* 0x10 data, DPL 0 */
    .quad   0x00cff3000000ffff      /* 0x18 data, DPL 3 */
    .quad   0x00affb000000ffff      /* 0x20 code, DPL 3 */
    .quad   __tss_desc_lo           /* 0x28 TSS, 16 bytes */
    .quad   __tss_desc_hi
gdt_end:
gdtr:
    .word   gdt_end - gdt - 1
    .quad   gdt
idtr:
    .word   IDT_GATES * 16 - 1
    .quad   IDT_GPA

/* 64-bit TSS: RSP0, the stack of every entry from CPL3, and an I/O bitmap
 * that allows every port. IOPL 3 alone should allow them, but kvm_pvm's
 * emulation of in/out at CPL3 consults the bitmap (#GP without it). */
    .balign 16
    .global tss
tss:
    .long   0
    .quad   kstack_top              /* rsp0 */
    .quad   0, 0                    /* rsp1, rsp2 */
    .quad   0                       /* reserved */
    .quad   0, 0, 0, 0, 0, 0, 0     /* ist1-7 */
    .quad   0                       /* reserved */
    .word   0
    .word   io_bitmap - tss         /* I/O map base */
io_bitmap:
    .skip   8192                    /* one bit per port, 0 = allowed */
    .byte   0xff                    /* the terminator the CPU may read */
    .global tss_end
tss_end:

    .global irq_count
    .balign 8
irq_count:
    .quad   0

    .section .bss
    .balign 16
stack:
    .skip   16384
stack_top:
kstack:
    .skip   8192 - 40
/* The frame an entry from CPL3 pushes at the top of this stack (rip, cs,
 * rflags, rsp, ss): a kernel call's user-mode frame (agent.c, kframe). */
    .global user_frame
user_frame:
    .skip   40
kstack_top:
